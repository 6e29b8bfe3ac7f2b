"""The shutdown backstop at the ASGI level: a request task that uvicorn cancels ends with
the 503 "shutting down" body if nothing was sent yet, and quietly if its response had
started; the task ends normally (uvicorn logs a traceback for anything it raises)."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.http.shutdown import QuietCancel


async def _cancelled_run(start_response: bool) -> list[dict]:
    """Run an app that hangs (after starting its response, if asked) under the middleware,
    cancel its task as uvicorn does at its deadline; the messages it sent."""
    sent: list[dict] = []
    hanging = asyncio.Event()

    async def receive() -> dict:
        await asyncio.Event().wait()
        return {}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive, send) -> None:
        if start_response:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        hanging.set()
        await receive()  # a body still arriving, a stream still waiting

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    task = asyncio.create_task(QuietCancel(app)(scope, receive, send))
    await hanging.wait()
    task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
    await task  # raises if the cancellation got out
    assert not task.cancelled() and task.cancelling() == 0
    return sent


def test_a_request_cancelled_before_its_response_gets_the_503_body(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent = asyncio.run(_cancelled_run(start_response=False))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 503
    headers = dict(sent[0]["headers"])
    assert headers[b"connection"] == b"close"
    assert int(headers[b"content-length"]) == len(sent[1]["body"])
    error = json.loads(sent[1]["body"])["error"]
    assert error == {
        "message": "The server is shutting down; retry the request",
        "type": "service_unavailable_error",
        "param": None,
        "code": "service_unavailable_error",
    }
    assert [r.exc_info for r in caplog.records] == [None]  # one line, no traceback


def test_a_started_response_is_left_as_it_was() -> None:
    sent = asyncio.run(_cancelled_run(start_response=True))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 200
