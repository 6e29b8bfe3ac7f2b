"""The serving skeleton with a front end of its own: named events, a failure trailer,
keep-alives, the non-streamed body and a client that leaves (fake engine).

The framing here is not OpenAI's (no ``[DONE]``, ``event:`` names), which is what
a second API front end brings; chat and completions are held byte for byte by
the live-API tests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field

import pytest
from fastapi.responses import Response
from pydantic import BaseModel
from test_generation import FakeEngine, _call, _ctx

from engine.api.errors import EngineDeadError
from engine.api.request import Request, RequestOutput
from engine.api.sampling_params import StructuredOutputSpec
from server.http.errors import APIError
from server.openai.generation import ChoiceUpdate, Generation, ServingContext
from server.openai.serving_base import CLIENT_CLOSED, EventFraming, ResponseBuilder, serve
from server.settings import ServerSettings


def _named_failure(error: APIError) -> Iterable[bytes]:
    return (b"event: error\ndata: " + json.dumps(error.body()).encode() + b"\n\n",)


NAMED = EventFraming(keep_alive=b"event: ping\ndata: {}\n\n", failure=_named_failure, done=None)


class Text(BaseModel):
    texts: list[str]


@dataclass
class Echo(ResponseBuilder):
    """Streams ``delta`` events of each choice's text; the body joins them."""

    n: int
    texts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.texts = [""] * self.n

    def opening(self) -> Iterator[bytes]:
        yield b"event: start\ndata: {}\n\n"

    def stream(self, gen: Generation, update: ChoiceUpdate) -> Iterator[bytes]:
        self.collect(update)
        yield f"event: delta\ndata: {update.index}:{update.output.text}\n\n".encode()

    def collect(self, update: ChoiceUpdate) -> None:
        self.texts[update.index] += update.output.text

    def closing(self, gen: Generation) -> Iterator[bytes]:
        yield f"event: stop\ndata: {gen.usage().completion_tokens}\n\n".encode()

    def body(self, gen: Generation) -> Text:
        return Text(texts=self.texts)


@dataclass
class FakeHttp:
    gone: bool = False
    headers: dict[str, str] = field(default_factory=dict)

    async def is_disconnected(self) -> bool:
        return self.gone


class FailingEngine(FakeEngine):
    """One output, then (once ``hold`` is set) the engine dies."""

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        async for out in super().generate(request):
            yield out
            await self.hold.wait()
            raise EngineDeadError("engine step failed: boom")


def _fast(ctx: ServingContext) -> ServingContext:
    ctx.settings = ServerSettings(keep_alive_s=0.01, disconnect_poll_s=0.01)
    return ctx


async def _send_all(
    response: Response, *, client_leaves: asyncio.Event | None = None
) -> list[bytes]:
    """Run ``response`` as the ASGI server would; the body chunks it sent."""
    chunks: list[bytes] = []
    leaves = client_leaves or asyncio.Event()

    async def receive() -> dict[str, str]:
        await leaves.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        body = message.get("body")
        if message["type"] == "http.response.body" and isinstance(body, bytes) and body:
            chunks.append(body)

    await response({"type": "http"}, receive, send)
    return chunks


async def _later(event: asyncio.Event, after_s: float) -> None:
    await asyncio.sleep(after_s)
    event.set()


def _serve(ctx: ServingContext, calls: list, builder: ResponseBuilder, **kw: object):
    http = kw.pop("http", FakeHttp())
    return serve(ctx, calls, builder, http_request=http, prompt_param="p", log_id="x", **kw)


def test_a_stream_has_opening_updates_keep_alives_closing_and_done() -> None:
    async def main() -> None:
        engine = FakeEngine()  # holds each stream after its first output: keep-alives
        ctx = _fast(_ctx(engine))
        response = await _serve(ctx, [_call("a", 0, 0, n=2)], Echo(2), stream=True)
        release = asyncio.create_task(_later(engine.hold, 0.1))
        chunks = await _send_all(response)
        await release
        assert chunks[0] == b"event: start\ndata: {}\n\n"
        assert b": keep-alive\n\n" in chunks  # the default framing is OpenAI's
        deltas = [c for c in chunks if c.startswith(b"event: delta")]
        assert sorted(deltas) == sorted(
            f"event: delta\ndata: {i}:x\n\n".encode() for i in (0, 1, 0, 1)
        )
        assert chunks[-2:] == [b"event: stop\ndata: 4\n\n", b"data: [DONE]\n\n"]
        assert engine.finished == ["a"] and ctx.admission.active == 0

    asyncio.run(main())


def test_a_framing_of_its_own_keeps_alive_and_ends_a_failed_stream_with_its_error() -> None:
    async def main() -> None:
        engine = FailingEngine()
        ctx = _fast(_ctx(engine))
        response = await _serve(ctx, [_call("a", 0, 0)], Echo(1), stream=True, framing=NAMED)
        release = asyncio.create_task(_later(engine.hold, 0.1))
        chunks = await _send_all(response)
        await release
        assert chunks[:2] == [b"event: start\ndata: {}\n\n", b"event: delta\ndata: 0:x\n\n"]
        assert NAMED.keep_alive in chunks and b": keep-alive\n\n" not in chunks
        assert chunks[-1].startswith(b"event: error\ndata: ")
        error = json.loads(chunks[-1].removeprefix(b"event: error\ndata: "))["error"]
        assert (error["type"], error["message"]) == (
            "service_unavailable_error",
            "The engine is not running",
        )
        assert not any(c.startswith(b"event: stop") for c in chunks)  # no closing events
        assert b"data: [DONE]\n\n" not in chunks and ctx.admission.active == 0

    asyncio.run(main())


def test_a_streaming_client_that_leaves_aborts_the_engine_request() -> None:
    async def main() -> None:
        engine = FakeEngine()  # never lets the stream past its first output
        ctx = _fast(_ctx(engine))
        response = await _serve(ctx, [_call("a", 0, 0)], Echo(1), stream=True)
        leaves = asyncio.Event()
        leave = asyncio.create_task(_later(leaves, 0.1))
        chunks = await _send_all(response, client_leaves=leaves)
        await leave
        assert b"data: [DONE]\n\n" not in chunks
        assert engine.abandoned == ["a"] and ctx.admission.active == 0

    asyncio.run(main())


def test_non_streamed_body_and_a_client_that_leaves() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.hold.set()
        ctx = _fast(_ctx(engine))
        response = await _serve(ctx, [_call("a", 0, 0, n=2)], Echo(2), stream=False)
        assert response.media_type == "application/json"
        assert json.loads(response.body) == {"texts": ["xx", "xx"]}
        assert ctx.admission.active == 0 and engine.finished == ["a"]

        waiting = FakeEngine()  # never lets its stream past the first output
        ctx = _fast(_ctx(waiting))
        gone = FakeHttp(gone=True)
        response = await _serve(ctx, [_call("b", 0, 0)], Echo(1), stream=False, http=gone)
        assert response.status_code == CLIENT_CLOSED
        assert waiting.abandoned == ["b"] and ctx.admission.active == 0

    asyncio.run(main())


SHUTTING_DOWN = ("service_unavailable_error", "The server is shutting down; retry the request")


def _error_of(chunk: bytes, prefix: bytes) -> tuple[str, str]:
    error = json.loads(chunk.removeprefix(prefix))["error"]
    return error["type"], error["message"]


def test_shutting_down_ends_each_open_request_in_its_own_framing() -> None:
    """The server stops with three requests open: a stream of a framing of its own, an
    OpenAI stream and a non-streamed one. Each ends with the same 503 as its framing
    says it; the engine requests are aborted and a request that comes later is refused."""

    async def main() -> None:
        engine = FakeEngine()  # holds every stream after its first output
        ctx = _fast(_ctx(engine))
        named = await _serve(ctx, [_call("a", 0, 0)], Echo(1), stream=True, framing=NAMED)
        openai = await _serve(ctx, [_call("b", 0, 0)], Echo(1), stream=True)
        plain = asyncio.create_task(_serve(ctx, [_call("c", 0, 0)], Echo(1), stream=False))
        sends = [asyncio.create_task(_send_all(r)) for r in (named, openai)]
        await asyncio.sleep(0.05)  # each has had its first output
        assert ctx.open_requests.shut_down() == 3
        named_chunks, openai_chunks = await asyncio.gather(*sends)
        with pytest.raises(APIError) as refused:
            await plain
        assert named_chunks[:2] == [b"event: start\ndata: {}\n\n", b"event: delta\ndata: 0:x\n\n"]
        assert _error_of(named_chunks[-1], b"event: error\ndata: ") == SHUTTING_DOWN
        assert b"data: [DONE]\n\n" not in named_chunks
        assert openai_chunks[-1] == b"data: [DONE]\n\n"
        assert _error_of(openai_chunks[-2], b"data: ") == SHUTTING_DOWN
        for chunks in (named_chunks, openai_chunks):  # no closing events after a failure
            assert not any(c.startswith(b"event: stop") for c in chunks)
        assert (refused.value.status, refused.value.message) == (503, SHUTTING_DOWN[1])
        assert sorted(engine.abandoned) == ["a", "b", "c"] and engine.finished == []
        assert ctx.admission.active == 0 and not ctx.open_requests.generations
        with pytest.raises(APIError) as later:
            await _serve(ctx, [_call("d", 0, 0)], Echo(1), stream=True)
        assert later.value.status == 503 and ctx.admission.active == 0

    asyncio.run(main())


class SilentEngine(FakeEngine):
    """Never answers: a grammar that is still compiling when the server stops."""

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        try:
            await asyncio.Event().wait()
            yield  # type: ignore[misc]  # never reached: an async generator
        finally:
            self.abandoned.append(request.request_id)


def test_shutting_down_ends_a_request_still_waiting_for_its_grammar() -> None:
    async def main() -> None:
        engine = SilentEngine()
        ctx = _fast(_ctx(engine))
        calls = [_call("a", 0, 0), _call("b", 1, 0)]
        for call in calls:
            call.request.sampling_params.structured = StructuredOutputSpec(json_schema="{}")
        served = asyncio.create_task(_serve(ctx, calls, Echo(2), stream=True))
        await asyncio.sleep(0.05)
        assert ctx.open_requests.shut_down() == 1
        with pytest.raises(APIError) as refused:  # before the stream starts: a 503 reply
            await served
        assert refused.value.message == SHUTTING_DOWN[1]
        assert sorted(engine.abandoned) == ["a", "b"] and ctx.admission.active == 0

    asyncio.run(main())
