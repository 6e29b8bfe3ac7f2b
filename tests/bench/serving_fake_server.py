"""A stand-in OpenAI-style streaming server for the bench client's own tests.

It streams ``max_tokens`` one-word chunks after a role-only chunk, then a finish
chunk and a usage chunk, with known sleeps, and exposes two flashserve counters
on /metrics that grow by known amounts per request. What it sends is a pure
function of the request, so tests can predict every record field the client
must have measured. It is not flashserve: the end-to-end test runs the real one.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

MODEL = "fake-model"
TEMPLATE_TOKENS = 7  # what a chat template would add
REPLAY_PER_REQUEST = 10
PAGE = 16


def prompt_tokens_of(body: dict[str, Any]) -> int:
    """Words of the prompt (the fake's 'tokenizer') plus a template."""
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"]) + TEMPLATE_TOKENS
    return len(body["prompt"].split())


def hit_tokens_of(prompt_tokens: int) -> int:
    """Whole pages below the last one: a deterministic stand-in for a cache."""
    return PAGE * max(0, (prompt_tokens - 1) // PAGE - 1)


@dataclass
class FakeState:
    first_delay_s: float = 0.0
    gap_s: float = 0.0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    requests: int = 0


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = [
            "# HELP flashserve:replay_tokens_total Replay rows.",
            "# TYPE flashserve:replay_tokens_total counter",
            f'flashserve:replay_tokens_total{{model_name="{MODEL}"}} '
            f"{REPLAY_PER_REQUEST * state.requests}.0",
            "# HELP flashserve:preemptions_total Preemptions.",
            "# TYPE flashserve:preemptions_total counter",
            f'flashserve:preemptions_total{{model_name="{MODEL}"}} {state.requests // 2}.0',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def stream(body: dict[str, Any], chat: bool):
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            n = body["max_tokens"]
            base = {"id": "x", "model": body["model"], "created": 0}
            await asyncio.sleep(state.first_delay_s)
            if chat:  # a role-only chunk first: not a token
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                yield _sse(base | {"choices": [role]})
            for i in range(n):
                if i:
                    await asyncio.sleep(state.gap_s)
                word = f"w{i} "
                choice = {"index": 0, "delta": {"content": word}} if chat else {"text": word}
                yield _sse(base | {"choices": [choice | {"index": 0}]})
            finish = {"index": 0, "delta": {}, "finish_reason": "length"}
            yield _sse(base | {"choices": [finish]})
            p = prompt_tokens_of(body)
            usage = {
                "prompt_tokens": p,
                "completion_tokens": n,
                "total_tokens": p + n,
                "prompt_cache_hit_tokens": hit_tokens_of(p),
                "prompt_cache_miss_tokens": p - hit_tokens_of(p),
            }
            yield _sse(base | {"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
            state.requests += 1
        finally:
            state.in_flight -= 1

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        body = await request.json()
        state.bodies.append(body)
        return StreamingResponse(stream(body, True), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> StreamingResponse:
        body = await request.json()
        state.bodies.append(body)
        return StreamingResponse(stream(body, False), media_type="text/event-stream")

    return app


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class FakeServer:
    """The fake app served by uvicorn on a loopback port in a background thread."""

    def __init__(self, state: FakeState) -> None:
        self.state = state
        config = uvicorn.Config(make_app(state), host="127.0.0.1", port=0, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        sock = self.server.servers[0].sockets[0]
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
