"""The body-size middleware at the ASGI level: refuse early, replay what it read."""

from __future__ import annotations

import asyncio
import json

from server.http.body_limit import BodySizeLimit

LIMIT = 10


def _run(headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> tuple[list[dict], list]:
    """Send ``chunks`` through the middleware; returns (messages sent, what the app saw)."""
    incoming = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ] + [{"type": "http.disconnect"}]
    sent: list[dict] = []
    seen: list = []

    async def receive() -> dict:
        return incoming.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive, send) -> None:
        while True:
            message = await receive()
            seen.append(message)
            if message["type"] == "http.disconnect":
                return

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    asyncio.run(BodySizeLimit(app, LIMIT)(scope, receive, send))
    return sent, seen


def _is_413(sent: list[dict]) -> bool:
    status = sent[0]["status"]
    body = json.loads(sent[1]["body"])
    return status == 413 and body["error"]["type"] == "invalid_request_error"


def test_declared_length_over_the_limit_is_refused_unread() -> None:
    sent, seen = _run([(b"content-length", b"11")], [b"x" * 11])
    assert _is_413(sent) and seen == []


def test_chunked_body_over_the_limit_is_refused() -> None:
    sent, seen = _run([], [b"x" * 6, b"y" * 6])
    assert _is_413(sent) and seen == []


def test_body_at_the_limit_is_replayed_then_the_disconnect() -> None:
    sent, seen = _run([(b"content-length", b"10")], [b"x" * 4, b"y" * 6])
    assert sent == []
    assert [m.get("body") for m in seen[:2]] == [b"xxxx", b"yyyyyy"]
    assert seen[2] == {"type": "http.disconnect"}


def test_a_declared_length_of_5000_digits_is_a_413_not_a_500() -> None:
    """int() of 5,000 digits raises (Python's int-string limit): it once escaped."""
    sent, seen = _run([(b"content-length", b"9" * 5000)], [b"x"])
    assert _is_413(sent) and seen == []
    sent, _ = _run([(b"content-length", b"0" * 5000 + b"10")], [b"x" * 10])
    assert sent == []  # leading zeros: still ten bytes, at the limit
