"""Refuse request bodies over a byte limit with 413, or slower than a time limit with 408,
before anything parses them.

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which would
buffer streamed responses and hide client disconnects). A declared
``Content-Length`` over the limit is refused at once; a chunked body is read
up to the limit and refused as soon as it passes it. The body read is then
handed to the app unchanged, and later ``receive`` calls (the disconnect)
go to the server as before. A body not complete within ``read_timeout_s`` of the
request's start (a client trickling bytes to hold a connection) gets a 408.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.error_shapes import ErrorShape, render_error
from server.http.errors import APIError, request_too_large


class BodySizeLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        read_timeout_s: float | None = None,
        shapes: Sequence[ErrorShape] = (),
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.shapes = tuple(shapes)  # the error shape of each API's paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        # Compared as text first: past Python's int-string limit (4,300 digits) int()
        # raises, and a length of more digits than the limit's is over it anyway.
        if declared is not None and declared.isdigit() and _over(declared, self.max_bytes):
            await self._refuse(scope, send, request_too_large(self.max_bytes))
            return
        messages: list[Message] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = None if self.read_timeout_s is None else loop.time() + self.read_timeout_s
        while True:
            try:
                wait = None if deadline is None else max(0.0, deadline - loop.time())
                message = await asyncio.wait_for(receive(), wait)
            except TimeoutError:
                late = APIError(408, "The request body was not received in time")
                await self._refuse(scope, send, late)
                return
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left mid-body: let the app see it
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, send, request_too_large(self.max_bytes))
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, send: Send, error: APIError) -> None:
        status, payload = render_error(error, scope.get("path", ""), self.shapes)
        body = json.dumps(payload).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _over(declared: bytes, max_bytes: int) -> bool:
    digits = declared.lstrip(b"0") or b"0"
    return len(digits) > len(str(max_bytes)) or int(digits) > max_bytes
