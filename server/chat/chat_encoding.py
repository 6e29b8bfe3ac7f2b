"""The DeepSeek-V4.1 chat template as code: messages -> prompt text.

Tokenisation is separate: the text holds special tokens as strings (``<｜User｜>``
...), which the tokenizer maps to single ids. The rules follow DeepSeek's
reference encoder for V4.1 (``encoding/encoding.py`` of the checkpoint), which
docs/design/api.md restates with examples:

- ``BOS``, then each turn. The first turn opens with ``<｜System｜>`` when it is a
  system message or when thinking is on (the Reasoning Effort line goes there).
- ``system``: ``<｜System｜>`` + text (+ tool block, + response format block).
- ``user``: ``<｜User｜>`` + blocks joined by a blank line; ``tool`` messages are
  folded into the user turn as ``<tool_result>...</tool_result>`` blocks, in the
  order of the calls they answer.
- After a user turn (or a later system turn, or a trailing system/assistant turn)
  that is not followed by an assistant turn: ``<｜Assistant｜>`` and ``<think>``
  (thinking on) or ``</think>`` (off).
- ``assistant``: [reasoning + ``</think>``] + content + [blank line + calls
  block] + ``EOS``. With thinking on, reasoning is kept only for turns after the
  last user turn, unless the request has tools (then every turn keeps it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.api.special_tokens import (
    ASSISTANT,
    BOS,
    EOS,
    FIM_BEGIN,
    FIM_END,
    FIM_HOLE,
    SYSTEM,
    THINK_END,
    THINK_START,
    USER,
)
from server.chat.tool_calls import render_tool_calls, render_tools, to_json
from server.http.errors import APIError
from server.openai.protocol import (
    ChatMessage,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)

REASONING_EFFORT_LINE = (
    "Reasoning Effort: {budget} "
    "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
RESPONSE_FORMAT_BLOCK = (
    "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
)
TOOL_RESULT = "<tool_result>{content}</tool_result>"
# DeepSeek's 400 when a past tool-call turn lost its reasoning, word for word.
REASONING_NOT_PASSED_BACK = (
    "The `reasoning_content` in the thinking mode must be passed back to the API."
)


@dataclass(slots=True)
class _Turn:
    """A message after tool results are folded into user turns."""

    role: str  # "system" | "user" | "assistant"
    text: str = ""
    blocks: list[tuple[str, str | None]] = field(default_factory=list)  # (text, tool_call_id)
    reasoning: str | None = None
    tool_calls: list[tuple[str, str | Mapping[str, Any]]] = field(default_factory=list)
    call_ids: list[str | None] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    response_format: dict[str, Any] | None = None


def _fold(messages: Sequence[ChatMessage]) -> list[_Turn]:
    """Consecutive user and tool messages become one user turn of blocks."""
    turns: list[_Turn] = []
    for m in messages:
        if m.role in ("user", "tool"):
            block = (m.text(), m.tool_call_id if m.role == "tool" else None)
            if turns and turns[-1].role == "user":
                turns[-1].blocks.append(block)
            else:
                turns.append(_Turn("user", blocks=[block]))
        elif m.role == "assistant":
            calls = m.tool_calls or []
            turns.append(
                _Turn(
                    "assistant",
                    text=m.text(),
                    reasoning=m.reasoning_content,
                    tool_calls=[(c.function.name, c.function.arguments) for c in calls],
                    call_ids=[c.id for c in calls],
                )
            )
        else:
            turns.append(_Turn("system", text=m.text()))
    _order_tool_results(turns)
    return turns


def _order_tool_results(turns: list[_Turn]) -> None:
    """Tool results follow the order of the calls of the last assistant turn before them."""
    order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            order = {cid: i for i, cid in enumerate(turn.call_ids) if cid}
        elif turn.role == "user" and order:
            slots = [i for i, (_, cid) in enumerate(turn.blocks) if cid is not None]
            ranked = sorted((turn.blocks[i] for i in slots), key=lambda b: order.get(b[1] or "", 0))
            for slot, block in zip(slots, ranked, strict=True):
                turn.blocks[slot] = block


def _block_text(text: str, tool_call_id: str | None) -> str:
    return text if tool_call_id is None else TOOL_RESULT.format(content=text)


def check_reasoning_passed_back(
    messages: Sequence[ChatMessage], *, has_tools: bool, thinking: bool
) -> None:
    """DeepSeek's rule: with thinking and tools, past tool-call turns must keep their reasoning.

    The encoder renders every past turn's reasoning when tools are present, so a
    missing one would silently change the prompt the model was trained on.
    """
    if not (thinking and has_tools):
        return
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls and m.reasoning_content is None:
            raise APIError(400, REASONING_NOT_PASSED_BACK, param=f"messages[{i}].reasoning_content")


def encode_chat(
    messages: Sequence[ChatMessage],
    *,
    tools: Sequence[Tool] | None = None,
    tool_choice: str | NamedToolChoice | None = None,
    thinking: bool,
    reasoning_effort: int,
    prefix_completion: bool = False,
    response_format: ResponseFormat | None = None,
) -> str:
    """The V4.1 prompt for ``messages``, ending where the model's output begins.

    ``reasoning_effort`` is the numeric budget (1-100). ``tool_choice`` does not
    change the text: tools are listed whatever the choice, so a conversation
    keeps its prompt (and its cached prefix) when the choice changes; forcing
    or forbidding calls is the sampler's job. With ``prefix_completion`` the last
    message is an assistant prefix the model continues: it gets no EOS, and if
    it holds only reasoning, the reasoning stays open.
    """
    del tool_choice  # see the docstring
    if not 1 <= reasoning_effort <= 100:
        raise ValueError(f"reasoning_effort {reasoning_effort} is outside [1, 100]")
    if not messages:
        raise ValueError("no messages")
    if prefix_completion and messages[-1].role != "assistant":
        raise APIError(400, "prefix completion needs a final assistant message", param="messages")
    check_reasoning_passed_back(messages, has_tools=bool(tools), thinking=thinking)

    turns = _fold(messages)
    functions = [t.function.schema_for_prompt() for t in tools or []]
    fmt = _response_format_object(response_format)
    if functions or fmt:
        if turns[0].role != "system":
            turns.insert(0, _Turn("system"))
        turns[0].tools, turns[0].response_format = functions, fmt
    # The reference keeps every turn's reasoning when the request has tools.
    keep_all_reasoning = bool(functions)
    last_user = max(
        (i for i, t in enumerate(turns) if t.role == "user" or (t.role == "system" and i > 0)),
        default=-1,
    )

    out = [BOS]
    for i, turn in enumerate(turns):
        is_last = i == len(turns) - 1
        if i == 0:
            effort = REASONING_EFFORT_LINE.format(budget=reasoning_effort) if thinking else ""
            if effort or turn.role == "system":
                out.append(SYSTEM + effort)
        if turn.role == "system":
            out.append(_render_system(turn, mid_conversation=i > 0))
        elif turn.role == "user":
            out.append(USER + "\n\n".join(_block_text(t, cid) for t, cid in turn.blocks))
        else:
            shows_reasoning = thinking and (keep_all_reasoning or i > last_user)
            open_prefix = prefix_completion and is_last
            out.append(_render_assistant(turn, shows_reasoning, open_prefix))
        if prefix_completion and is_last:
            break  # the model continues this turn: no header after it
        next_role = turns[i + 1].role if not is_last else None
        if next_role is not None and next_role != "assistant":
            continue
        if turn.role == "user" or (turn.role == "system" and i > 0) or is_last:
            opens_reasoning = thinking and (keep_all_reasoning or i >= last_user)
            out.append(ASSISTANT + (THINK_START if opens_reasoning else THINK_END))
    return "".join(out)


def _response_format_object(response_format: ResponseFormat | None) -> dict[str, Any] | None:
    """The object the response-format block shows (the request's, as sent); none for text."""
    if response_format is None or response_format.type == "text":
        return None
    return response_format.model_dump(exclude_none=True, by_alias=True)


def _render_system(turn: _Turn, *, mid_conversation: bool) -> str:
    text = (SYSTEM if mid_conversation else "") + turn.text
    if turn.tools:
        text += "\n\n" + render_tools(turn.tools)
    if turn.response_format:
        text += "\n\n" + RESPONSE_FORMAT_BLOCK.format(schema=to_json(turn.response_format))
    return text


def _render_assistant(turn: _Turn, shows_reasoning: bool, open_prefix: bool) -> str:
    calls = "\n\n" + render_tool_calls(turn.tool_calls) if turn.tool_calls else ""
    reasoning = ""
    if shows_reasoning:
        reasoning = (turn.reasoning or "") + THINK_END
        # A prefix holding only reasoning continues the reasoning itself.
        if open_prefix and turn.reasoning and not turn.text and not calls:
            reasoning = turn.reasoning
    return reasoning + turn.text + calls + ("" if open_prefix else EOS)


def ends_inside_reasoning(prompt: str) -> bool:
    """The model's output starts inside ``<think>`` (its first text is reasoning)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def encode_fim(prompt: str, suffix: str | None) -> str:
    """Fill-in-the-middle prompt (prefix-suffix-middle): the model writes the middle."""
    return f"{BOS}{FIM_BEGIN}{prompt}{FIM_HOLE}{suffix or ''}{FIM_END}"


def encode_completion(prompt: str) -> str:
    """A plain completion prompt."""
    return BOS + prompt
