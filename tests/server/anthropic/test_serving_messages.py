"""The raw event stream of ``/v1/messages``, event by event, against Anthropic's documented
order (``messages_helpers.check_event_order``), over plain HTTP with ``event:`` lines.

A fake engine that dies after its first output shows the mid-stream ``error`` event.

Oracles: the non-streamed answer of the same greedy request (the stream's blocks
must fold into it) and a thinking block's signature computed here. A streamed
tool call's events are checked in test_api_message_tools.py (one forced call
serves both tests: each costs ~90 tokens of the random model).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import ClassVar

from api_helpers import LiveServer
from messages_helpers import (
    GREEDY,
    HELLO,
    blocks,
    check_event_order,
    post,
    raw_events,
    signature_of,
)
from starlette.responses import StreamingResponse

from engine.api.errors import EngineDeadError
from engine.api.request import CompletionOutput, Request, RequestMetrics, RequestOutput, Usage
from server.anthropic.protocol import MessagesRequest
from server.anthropic.serving_messages import ANTHROPIC_SSE, MessagesResponse
from server.chat.chat_plan import ChatPlan
from server.metrics.metrics import ServerMetrics
from server.openai.generation import EngineCall, ServingContext
from server.openai.serving_base import serve
from server.settings import ServerSettings


def test_a_text_stream_event_by_event(live_server: LiveServer) -> None:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": HELLO, **GREEDY}
    whole = post(live_server, "/anthropic/v1/messages", body).json()
    events = raw_events(live_server, body)
    check_event_order(events)
    names = [n for n, _ in events]
    # Exactly the documented example's shape: start, block start, ping, deltas, stops.
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6)
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == []
    assert start["model"] == "claude-sonnet-4-5" and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    built = blocks(events)
    assert [b["text"] for b in built] == [b["text"] for b in whole["content"]]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


def test_a_thinking_stream_ends_its_block_with_the_signature(live_server: LiveServer) -> None:
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 5,
        "messages": HELLO,
        "thinking": {"type": "enabled", "budget_tokens": 2000},
        **GREEDY,
    }
    events = raw_events(live_server, body)
    check_event_order(events)
    assert events[1][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas[-1] == "signature_delta" and deltas.count("signature_delta") == 1
    assert set(deltas[:-1]) == {"thinking_delta"}
    (block,) = blocks(events)
    assert block["signature"] == signature_of(block["thinking"])
    whole = post(live_server, "/v1/messages", body).json()
    assert whole["content"] == [
        {"type": "thinking", "thinking": block["thinking"], "signature": block["signature"]}
    ]


class _DyingEngine:
    """One output of text, then the engine fails (a step raised)."""

    is_running = True

    def validate(self, request: Request) -> None:
        pass

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        usage = Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=1)
        metrics = RequestMetrics(0.0, 0.1, 0.2, 0.3, None)
        yield RequestOutput(
            request.request_id, [CompletionOutput(0, "Hi", [7])], False, usage, metrics
        )
        raise EngineDeadError("engine step failed: boom")


class _Vocab:
    """The two tokenizer calls serving makes here."""

    def token_to_id(self, token: str) -> None:
        return None

    def get_vocab(self, with_added_tokens: bool) -> dict[str, int]:
        return {"Hi": 7}


def test_an_engine_failure_mid_stream_is_an_error_event() -> None:
    async def main() -> list[bytes]:
        ctx = ServingContext(
            engine=_DyingEngine(),  # type: ignore[arg-type]
            settings=ServerSettings(keep_alive_s=0.01, disconnect_poll_s=0.01),
            metrics=ServerMetrics("m"),
            tokenizer=_Vocab(),  # type: ignore[arg-type]
            token_texts=None,  # type: ignore[arg-type]
        )
        body = MessagesRequest.model_validate(
            {"model": "claude-x", "max_tokens": 4, "messages": HELLO, "stream": True}
        )
        plan = ChatPlan(
            id="chatcmpl-abc",
            created=0,
            model="deepseek-flash",
            thinking=False,
            starts_in_reasoning=False,
            parse_tools=False,
            forced_calls=False,
            logprobs=False,
            calls=[EngineCall(Request("r", [1, 2, 3]), 0)],
        )

        class _Http:
            headers: ClassVar[dict[str, str]] = {}

            async def is_disconnected(self) -> bool:
                return False

        response = await serve(
            ctx,
            plan.calls,
            MessagesResponse(ctx, body, plan),
            stream=True,
            http_request=_Http(),  # type: ignore[arg-type]
            prompt_param="messages",
            log_id="x",
            framing=ANTHROPIC_SSE,
        )
        assert isinstance(response, StreamingResponse)
        return [chunk async for chunk in response.body_iterator]  # type: ignore[misc]

    chunks = b"".join(asyncio.run(main())).decode()
    events = [
        (block.split("\n")[0].removeprefix("event: "), json.loads(block.split("\n")[1][6:]))
        for block in chunks.strip().split("\n\n")
        if block.startswith("event: ")
    ]
    names = [n for n, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "error",
    ]
    assert events[0][1]["message"]["id"] == "msg_abc"
    assert events[3][1]["delta"] == {"type": "text_delta", "text": "Hi"}
    assert events[-1][1] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "The engine is not running"},
    }
