"""A uvicorn HTTP/1.1 protocol that closes connections whose request headers never finish.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) but not a
client that sends its headers a byte at a time: that connection, and the
file descriptor and memory it holds, would stay open forever (a slowloris).
Here every connection must complete a request's headers within
``header_timeout_s`` of opening, or of its previous response ending; else it
gets a 408 and is closed. The body is bounded by ``BodySizeLimit``'s read
timeout (server/http/body_limit.py).
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.h11_impl import H11Protocol

from server.http.errors import APIError

_TIMEOUT_BODY = json.dumps(
    APIError(408, "The request headers were not received in time").body()
).encode()
_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n"
) + _TIMEOUT_BODY


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """An ``H11Protocol`` subclass with ``header_timeout_s`` (uvicorn ``Config(http=...)``)."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            # A new request (its headers parsed) replaces ``cycle``; the same cycle at
            # the deadline means no request's headers completed in time.
            armed = self.cycle

            def expire() -> None:
                idle_or_partial = armed is None or armed.response_complete
                if self.cycle is armed and idle_or_partial and not self.transport.is_closing():
                    self.transport.write(_TIMEOUT_RESPONSE)
                    self.transport.close()

            self.loop.call_later(header_timeout_s, expire)

    return HeaderTimeoutH11Protocol
