"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` (also under ``/anthropic``).

The request becomes the chat request the OpenAI path plans (``translate.py``),
``plan_chat`` plans it, and ``serve`` runs it; what is Anthropic's is only the
answer: content blocks (``thinking`` with a signature, ``text``, ``tool_use``)
read from the same ``ChatOutputParser`` the chat path uses, as one ``Message``
body or as Anthropic's named events:

    message_start, then per block: content_block_start, content_block_delta...,
    content_block_stop (a ``ping`` after the first block's start), then
    message_delta (stop_reason, stop_sequence, usage) and message_stop.

``message_start`` waits for the engine's first output, which says how much of
the prompt the prefix cache held; until then the stream sends SSE comments as
keep-alives, which SSE clients skip (the SDKs refuse any event before
``message_start``). A failure mid-stream is an ``error`` event, and the stream ends.

Thinking blocks carry a signature: a digest of their text, so a client that
passes a block back unchanged sends what it got. Nothing checks it on the way
in; it proves nothing, as nothing here holds a secret to sign with.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from engine.api.special_tokens import THINK_END
from server.anthropic.errors import anthropic_error_body
from server.anthropic.protocol import (
    ContentOut,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    MessageUsage,
    StopReason,
    TextOut,
    ThinkingOut,
    ToolUseOut,
)
from server.anthropic.translate import to_chat_request
from server.chat.chat_output import ChatOutputParser, ChatPiece
from server.chat.chat_plan import ChatPlan, fetch_chat_images, plan_chat
from server.http.errors import APIError
from server.http.sse import KEEP_ALIVE
from server.openai.generation import ChoiceUpdate, Generation, ServingContext
from server.openai.protocol import Usage as ChatUsage
from server.openai.sampling import check_fan_out
from server.openai.serving_base import EventFraming, ResponseBuilder, serve

_SIGNATURE_PERSON = b"fs-thinking-v1"


def named_event(name: str, payload: dict[str, Any]) -> bytes:
    """One Anthropic SSE event: ``event: NAME`` and its ``data:`` JSON."""
    data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


def _failure(error: APIError) -> Iterable[bytes]:
    return (named_event("error", anthropic_error_body(error)),)


ANTHROPIC_SSE = EventFraming(keep_alive=KEEP_ALIVE, failure=_failure, done=None)


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def thinking_signature(thinking: str) -> str:
    """A thinking block's signature: a digest of its text (see the module docstring)."""
    digest = hashlib.blake2b(thinking.encode(), digest_size=24, person=_SIGNATURE_PERSON)
    return digest.hexdigest()


def message_usage(usage: ChatUsage) -> MessageUsage:
    """Anthropic's usage: ``input_tokens`` is the prompt less its prefix-cache hit."""
    hit = usage.prompt_cache_hit_tokens
    return MessageUsage(
        input_tokens=usage.prompt_tokens - hit,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=hit,
        cache_creation_input_tokens=0,
    )


async def create_message(
    ctx: ServingContext, body: MessagesRequest, *, api_key: str | None, http_request: HttpRequest
) -> Response:
    check_fan_out(ctx, 1, 1)
    chat = to_chat_request(body, ctx.settings.served_model_name)
    fetched = await fetch_chat_images(ctx, chat)
    plan = await ctx.offload(plan_chat, ctx, chat, api_key, fetched)
    return await serve(
        ctx,
        plan.calls,
        MessagesResponse(ctx, body, plan),
        stream=body.stream,
        http_request=http_request,
        prompt_param="messages",
        log_id=plan.id,
        framing=ANTHROPIC_SSE,
    )


async def count_tokens(
    ctx: ServingContext, body: CountTokensRequest, *, api_key: str | None
) -> CountTokensResponse:
    """The prompt's length as a ``create`` of the same body would send it to the engine
    (each image's span included)."""
    chat = to_chat_request(body, ctx.settings.served_model_name, for_counting=True)
    fetched = await fetch_chat_images(ctx, chat)

    def count() -> int:
        plan = plan_chat(ctx, chat, api_key, fetched)
        return len(plan.calls[0].request.prompt_token_ids)

    return CountTokensResponse(input_tokens=await ctx.offload(count))


class MessagesResponse(ResponseBuilder):
    """One message: the chat parser's pieces as content blocks (streamed or whole)."""

    def __init__(self, ctx: ServingContext, body: MessagesRequest, plan: ChatPlan) -> None:
        self._body = body
        self._plan = plan
        self._id = "msg_" + plan.id.removeprefix("chatcmpl-")
        self._parser = ChatOutputParser(
            starts_in_reasoning=plan.starts_in_reasoning,
            parse_tools=plan.parse_tools,
            forced_calls=plan.forced_calls,
            think_end_id=ctx.tokenizer.token_to_id(THINK_END),
            call_id=new_tool_use_id,
        )
        self._stop_string: str | None = None
        # Stream state: the open block (kind, index) and the current thinking text.
        self._started = False
        self._pinged = False
        self._open: str | None = None
        self._next_index = 0
        self._thinking = ""

    # ------------------------------------------------------------ shared
    def _take(self, update: ChoiceUpdate) -> ChatPiece:
        out = update.output
        if isinstance(out.stop_reason, str) and out.stop_reason in (
            self._body.stop_sequences or ()
        ):
            self._stop_string = out.stop_reason
        return self._parser.feed(out)

    def _stop_reason(self) -> StopReason:
        finish = self._parser.finish_reason
        if finish == "tool_calls":
            return "tool_use"
        if finish == "length":
            return "max_tokens"
        return "stop_sequence" if self._stop_string is not None else "end_turn"

    def _shell(self, content: list[ContentOut], usage: MessageUsage, done: bool) -> MessageResponse:
        return MessageResponse(
            id=self._id,
            model=self._body.model,  # as the client named it
            content=content,
            stop_reason=self._stop_reason() if done else None,
            stop_sequence=self._stop_string if done else None,
            usage=usage,
        )

    # ------------------------------------------------------------ streamed
    def stream(self, gen: Generation, update: ChoiceUpdate) -> Iterator[bytes]:
        if not self._started:
            yield from self._message_start(gen)
        piece = self._take(update)
        if self._plan.thinking and piece.reasoning:
            yield from self._ensure_block("thinking", {"thinking": "", "signature": ""})
            self._thinking += piece.reasoning
            yield self._delta({"type": "thinking_delta", "thinking": piece.reasoning})
        if piece.content:
            yield from self._ensure_block("text", {"text": ""})
            yield self._delta({"type": "text_delta", "text": piece.content})
        for call in piece.tool_calls:
            if call.id is not None:  # a new call: a block of its own
                yield from self._close_block()
                header = {"id": call.id, "name": call.name or "", "input": {}}
                yield from self._ensure_block("tool_use", header)
            if call.arguments:
                yield self._delta({"type": "input_json_delta", "partial_json": call.arguments})
        if update.output.finished:
            yield from self._close_block()

    def _message_start(self, gen: Generation) -> Iterator[bytes]:
        self._started = True
        shell = self._shell([], message_usage(gen.usage()), done=False)
        yield named_event("message_start", {"type": "message_start", "message": shell.model_dump()})

    def _ensure_block(self, kind: str, fields: dict[str, Any]) -> Iterator[bytes]:
        if self._open == kind and kind != "tool_use":
            return
        yield from self._close_block()
        self._open = kind
        block = {"type": kind, **fields}
        index = self._next_index
        yield named_event(
            "content_block_start",
            {"type": "content_block_start", "index": index, "content_block": block},
        )
        if not self._pinged:
            self._pinged = True
            yield named_event("ping", {"type": "ping"})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        payload = {"type": "content_block_delta", "index": self._next_index, "delta": delta}
        return named_event("content_block_delta", payload)

    def _close_block(self) -> Iterator[bytes]:
        if self._open is None:
            return
        if self._open == "thinking":
            signature = thinking_signature(self._thinking)
            yield self._delta({"type": "signature_delta", "signature": signature})
            self._thinking = ""
        stop = {"type": "content_block_stop", "index": self._next_index}
        yield named_event("content_block_stop", stop)
        self._open = None
        self._next_index += 1

    def closing(self, gen: Generation) -> Iterator[bytes]:
        if not self._started:
            yield from self._message_start(gen)
        yield from self._close_block()
        usage = message_usage(gen.usage(self._parser.reasoning_tokens))
        delta = {"stop_reason": self._stop_reason(), "stop_sequence": self._stop_string}
        yield named_event(
            "message_delta",
            {"type": "message_delta", "delta": delta, "usage": usage.model_dump()},
        )
        yield named_event("message_stop", {"type": "message_stop"})

    # ------------------------------------------------------------ whole
    def collect(self, update: ChoiceUpdate) -> None:
        self._take(update)

    def body(self, gen: Generation) -> MessageResponse:
        total = self._parser.total
        content: list[ContentOut] = []
        if self._plan.thinking and total.reasoning:
            content.append(
                ThinkingOut(thinking=total.reasoning, signature=thinking_signature(total.reasoning))
            )
        if total.content:
            content.append(TextOut(text=total.content))
        for call in self._parser.calls:
            content.append(ToolUseOut(id=call.id, name=call.name, input=_input(call.arguments)))
        usage = message_usage(gen.usage(self._parser.reasoning_tokens))
        return self._shell(content, usage, done=True)


def _input(arguments: str) -> dict[str, Any]:
    """A call's ``input`` object; a call cut by ``max_tokens`` before its arguments
    closed has none that parse, and gets ``{}`` (its stop_reason says max_tokens)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
