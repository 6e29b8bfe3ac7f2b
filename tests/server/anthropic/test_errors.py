"""Anthropic's error shape and status codes, chosen by path for every way a request fails.

Oracle: Anthropic's documented error types per status (invalid_request_error 400,
authentication_error 401, not_found_error 404, request_too_large 413,
rate_limit_error 429, api_error 500) written out here, and the unchanged
OpenAI shape for every other path.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from server.anthropic.errors import ANTHROPIC_ERRORS, anthropic_error_body, anthropic_status
from server.http.error_shapes import render_error
from server.http.errors import APIError
from server.http.shutdown import QuietCancel


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, (400, "invalid_request_error")),
        (401, (401, "authentication_error")),
        (404, (404, "not_found_error")),
        (413, (413, "request_too_large")),
        (422, (400, "invalid_request_error")),  # the chat path's "invalid parameters"
        (429, (429, "rate_limit_error")),
        (500, (500, "api_error")),
        (503, (503, "overloaded_error")),
    ],
)
def test_status_and_type(status: int, expected: tuple[int, str]) -> None:
    assert anthropic_status(APIError(status, "x")) == expected


def test_the_path_chooses_the_shape() -> None:
    error = APIError(422, "temperature: out of range", param="temperature")
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/anthropic/v1/models"):
        status, body = render_error(error, path, (ANTHROPIC_ERRORS,))
        assert status == 400
        assert body == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "temperature: out of range"},
        }
    for path in ("/v1/chat/completions", "/v1/models", "/anthropicx"):
        assert render_error(error, path, (ANTHROPIC_ERRORS,)) == (422, error.body())
    assert anthropic_error_body(APIError(500, "boom"))["error"]["type"] == "api_error"


def test_the_shutdown_reply_of_a_messages_request_is_anthropics() -> None:
    sent: list[dict] = []

    async def run() -> None:
        started = asyncio.Event()

        async def app(scope, receive, send) -> None:
            started.set()
            await asyncio.Event().wait()

        async def send(message: dict) -> None:
            sent.append(message)

        async def receive() -> dict:
            return {}

        scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}
        task = asyncio.create_task(QuietCancel(app, (ANTHROPIC_ERRORS,))(scope, receive, send))
        await started.wait()
        task.cancel()
        await task

    asyncio.run(run())
    assert sent[0]["status"] == 503
    body = json.loads(sent[1]["body"])
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    assert "shutting down" in body["error"]["message"]
