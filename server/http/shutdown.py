"""The last answer of a request that the server cancels as it stops.

On SIGTERM ``flashserve serve`` drains: shortly before ``--shutdown-timeout`` it
ends every open generation with its API's 503 (``OpenRequests.shut_down`` in
server/openai/generation.py), and the responses finish on their own. What is
still running at the deadline (a body still arriving, a prompt still being
tokenised) uvicorn cancels; without this middleware each such task logs its
``CancelledError`` traceback as an application error. Here a cancelled request
whose response has not started gets the 503 "shutting down" body, one that has
started is left for uvicorn to close, and either way the log has one line.

A plain ASGI middleware, outside the others, so it sees the cancellation last.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http.error_shapes import ErrorShape, render_error
from server.http.errors import shutting_down

logger = logging.getLogger(__name__)


class QuietCancel:
    def __init__(self, app: ASGIApp, shapes: Sequence[ErrorShape] = ()) -> None:
        self.app = app
        self.shapes = tuple(shapes)  # the error shape of each API's paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except asyncio.CancelledError:
            # Only uvicorn's shutdown (or the loop's end) cancels a request's task; it
            # ends here, so the cancellation is taken back rather than re-raised.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            logger.warning(
                "%s %s cancelled: the server is stopping", scope.get("method"), scope.get("path")
            )
            if not started:
                await _reply(send, scope.get("path", ""), self.shapes)


async def _reply(send: Send, path: str, shapes: Sequence[ErrorShape]) -> None:
    status, payload = render_error(shutting_down(), path, shapes)
    body = json.dumps(payload).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
