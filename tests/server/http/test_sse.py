"""SSE framing, and the stream response's behaviour when the client goes (ASGI level)."""

from __future__ import annotations

import asyncio

from server.http.sse import DONE, KEEP_ALIVE, EventStreamResponse, event
from server.openai.protocol import ErrorInfo


def test_event_framing() -> None:
    assert event({"a": 1, "b": "é"}) == 'data: {"a":1,"b":"é"}\n\n'.encode()
    info = ErrorInfo(message="m", type="t")
    assert event(info, exclude={"code"}) == b'data: {"message":"m","type":"t","param":null}\n\n'
    assert DONE == b"data: [DONE]\n\n" and KEEP_ALIVE == b": keep-alive\n\n"


def _serve(response: EventStreamResponse, disconnect: asyncio.Event) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    async def main() -> None:
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)

    asyncio.run(main())
    return sent


def test_client_leaving_while_waiting_closes_the_generator() -> None:
    """The generator waits (a queued request) when the client leaves: it is cancelled at
    once, its cleanup runs, and ``on_close`` runs."""
    log: list[str] = []
    disconnect = asyncio.Event()

    async def events():
        try:
            yield b"data: 1\n\n"
            disconnect.set()  # the client leaves while we wait for the next event
            await asyncio.sleep(3600)
            yield b"never"
        finally:
            log.append("generator closed")

    async def on_close() -> None:
        log.append("on_close")

    sent = _serve(EventStreamResponse(events(), on_close=on_close), disconnect)
    assert sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]
    assert log == ["generator closed", "on_close"]


def test_finished_stream_runs_on_close_even_if_never_started() -> None:
    log: list[str] = []

    async def events():
        log.append("started")
        yield b"x"

    async def on_close() -> None:
        log.append("on_close")

    disconnect = asyncio.Event()
    disconnect.set()  # gone before the first event
    response = EventStreamResponse(events(), on_close=on_close)
    _serve(response, disconnect)
    assert log[-1] == "on_close"
