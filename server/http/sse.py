"""Server-sent events as OpenAI streams them: ``data: {json}`` events, one ``data: [DONE]``.

``EventStreamResponse`` watches for the client's disconnect while it streams,
even while no event is due (a request waiting in the queue), and cancels the
event generator when the client goes, so the engine request behind it is
aborted at once rather than at the next write.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = b"data: [DONE]\n\n"
# A comment line: clients skip it; proxies see bytes and keep the connection.
KEEP_ALIVE = b": keep-alive\n\n"
MEDIA_TYPE = "text/event-stream"


def event(payload: BaseModel | dict[str, Any], *, exclude: set[str] | None = None) -> bytes:
    """One ``data:`` event holding ``payload`` as compact JSON."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude=exclude)
    else:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + text.encode() + b"\n\n"


class WatchedStreamingResponse(StreamingResponse):
    """A streamed response that stops its generator when the client leaves.

    ``on_close`` runs once the stream ends for any reason (finished, client
    gone, failed), even if the generator never started.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        status_code: int = 200,
        media_type: str | None = None,
        headers: dict[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(content, status_code=status_code, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()  # the client left: stop streaming
        except BaseExceptionGroup as errors:
            if len(errors.exceptions) == 1:
                raise errors.exceptions[0] from None
            raise
        finally:
            # Shielded: a server shutting down must still abort the engine request.
            with anyio.CancelScope(shield=True):
                iterator = self.body_iterator
                if hasattr(iterator, "aclose"):
                    await iterator.aclose()
                if self._on_close is not None:
                    await self._on_close()


class EventStreamResponse(WatchedStreamingResponse):
    """A ``text/event-stream`` response that stops its generator when the client leaves."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(
            content,
            media_type=MEDIA_TYPE,
            # no-cache: never replay a stream; X-Accel-Buffering: nginx must not buffer it.
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            on_close=on_close,
        )
