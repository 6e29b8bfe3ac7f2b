"""One chat choice's engine deltas -> ``reasoning_content``, ``content`` and tool calls.

Text goes through the ``</think>`` splitter (when the output starts inside
reasoning), then the answer part through the DSML parser (when calls are
parsed). Token-level facts follow the ``</think>`` token: tokens up to and
including it are reasoning tokens, and their logprobs are reported under
``logprobs.reasoning_content``. The same parser serves streamed and whole
responses, so both say the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.api.request import CompletionOutput
from server.chat.reasoning import ReasoningParser
from server.chat.tool_calls import (
    ParseDelta,
    ParsedToolCall,
    ToolCallDelta,
    ToolCallParser,
    new_call_id,
)
from server.openai.logprobs import TokenTexts
from server.openai.protocol import (
    ChatDelta,
    ChoiceLogprobs,
    DeltaFunction,
    DeltaToolCall,
    FinishReason,
    FunctionCallOut,
    ResponseMessage,
    TokenLogprob,
    ToolCallOut,
)


@dataclass(slots=True)
class ChatPiece:
    """What one engine delta adds to a choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning_logprobs: list[TokenLogprob] = field(default_factory=list)
    content_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (
            self.reasoning
            or self.content
            or self.tool_calls
            or self.reasoning_logprobs
            or self.content_logprobs
        )

    def delta(self, thinking: bool) -> ChatDelta:
        return ChatDelta(
            reasoning_content=self.reasoning if thinking and self.reasoning else None,
            content=self.content or None,
            tool_calls=[_delta_call(c) for c in self.tool_calls] or None,
        )

    def logprobs(self) -> ChoiceLogprobs:
        return ChoiceLogprobs(
            content=self.content_logprobs, reasoning_content=self.reasoning_logprobs or None
        )


def _delta_call(call: ToolCallDelta) -> DeltaToolCall:
    if call.id is not None:
        return DeltaToolCall(
            index=call.index,
            id=call.id,
            type="function",
            function=DeltaFunction(name=call.name, arguments=call.arguments),
        )
    return DeltaToolCall(index=call.index, function=DeltaFunction(arguments=call.arguments))


class ChatOutputParser:
    """Parses one choice incrementally and keeps its totals for a whole response."""

    def __init__(
        self,
        *,
        starts_in_reasoning: bool,
        parse_tools: bool,
        think_end_id: int | None,
        token_texts: TokenTexts | None = None,
        forced_calls: bool = False,
        call_id: Callable[[], str] = new_call_id,
    ) -> None:
        """``token_texts``: set when the request asked for logprobs. ``forced_calls``: a
        grammar makes the answer one calls block (``tool_choice`` required or named), so
        it carries no content, even when ``max_tokens`` cuts the block short.
        ``call_id``: makes each call's id (each API has its own prefix)."""
        self._reasoning = ReasoningParser() if starts_in_reasoning else None
        self._tools = ToolCallParser(call_id, forced=forced_calls) if parse_tools else None
        self._forced_calls = forced_calls
        self._think_end_id = think_end_id
        self._texts = token_texts
        self._in_reasoning_tokens = starts_in_reasoning
        self.reasoning_tokens = 0
        self.total = ChatPiece()
        self.engine_finish: str | None = None

    def feed(self, out: CompletionOutput) -> ChatPiece:
        """The piece of ``out``; on the choice's last output, everything held back too."""
        piece = ChatPiece()
        self._tokens(out, piece)
        self._text(out.text, piece)
        if out.finish_reason is not None:
            self.engine_finish = out.finish_reason
            self._flush(piece)
        self._add_to_total(piece)
        return piece

    def _tokens(self, out: CompletionOutput, piece: ChatPiece) -> None:
        """Count reasoning tokens and split logprobs at the ``</think>`` token."""
        logprobs = out.logprobs or []
        for i, token_id in enumerate(out.token_ids):
            was_reasoning = self._in_reasoning_tokens
            if was_reasoning:
                self.reasoning_tokens += 1
                self._in_reasoning_tokens = token_id != self._think_end_id
            if self._texts is not None and i < len(logprobs):
                entry = self._texts.chat_entry(logprobs[i])
                (piece.reasoning_logprobs if was_reasoning else piece.content_logprobs).append(
                    entry
                )

    def _text(self, text: str, piece: ChatPiece) -> None:
        if self._reasoning is not None and self._reasoning.in_reasoning:
            reasoning, answer = self._reasoning.feed(text)
            piece.reasoning += reasoning
            if not self._reasoning.in_reasoning:
                # The text split ended reasoning without the </think> id (written in pieces).
                self._in_reasoning_tokens = False
        else:
            answer = text
        self._answer(answer, piece)

    def _answer(self, text: str, piece: ChatPiece) -> None:
        if self._tools is None:
            piece.content += text
        elif text:
            _merge(piece, self._tools.feed(text))

    def _flush(self, piece: ChatPiece) -> None:
        if self._reasoning is not None and self._reasoning.in_reasoning:
            reasoning, _ = self._reasoning.finish()
            piece.reasoning += reasoning
        if self._tools is not None:
            _merge(piece, self._tools.finish())

    def _add_to_total(self, piece: ChatPiece) -> None:
        t = self.total
        t.reasoning += piece.reasoning
        t.content += piece.content
        t.reasoning_logprobs += piece.reasoning_logprobs
        t.content_logprobs += piece.content_logprobs

    # ------------------------------------------------------------ results
    @property
    def finish_reason(self) -> FinishReason:
        """``tool_calls`` when the model called and closed its calls block; ``length``
        when the budget cut the output (a call included) before that."""
        if self._tools is not None and self._tools.complete:
            # Under a grammar only EOS follows a closed block: the calls are whole even
            # when the budget ran out exactly there.
            return "tool_calls"
        if self.engine_finish == "length":
            return "length"
        if self._tools is not None and self._tools.has_calls:
            return "tool_calls"
        return "stop"

    @property
    def calls(self) -> list[ParsedToolCall]:
        """The tool calls so far (a call cut by ``max_tokens`` with its partial arguments)."""
        return self._tools.tool_calls if self._tools is not None else []

    def message(self, thinking: bool) -> ResponseMessage:
        """The whole ``message`` of a non-streamed choice."""
        calls = self.calls
        tool_calls = [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for c in calls
        ]
        only_calls = bool(tool_calls) or (self._forced_calls and self._tools is not None)
        return ResponseMessage(
            # OpenAI: content is null when the answer is only tool calls (a forced call cut
            # before its header completed included: its answer was never text).
            content=self.total.content if self.total.content or not only_calls else None,
            reasoning_content=self.total.reasoning if thinking else None,
            tool_calls=tool_calls or None,
        )

    def logprobs(self) -> ChoiceLogprobs | None:
        if self._texts is None:
            return None
        return self.total.logprobs()


def _merge(piece: ChatPiece, delta: ParseDelta) -> None:
    piece.content += delta.content
    for call in delta.tool_calls:
        last = piece.tool_calls[-1] if piece.tool_calls else None
        # Fragments of one call within one piece are joined; a call's header stays apart.
        if last is not None and last.id is None and call.id is None and last.index == call.index:
            last.arguments += call.arguments
        else:
            piece.tool_calls.append(call)
