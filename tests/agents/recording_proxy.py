"""A loopback HTTP proxy that records every exchange between a coding agent and the server.

The agent tests point an agent at this proxy instead of the server, so they can check
what the server saw and answered with an oracle that is neither the server nor the
agent: the status of every request, the tool calls the server's responses carried and
the tool results the agent sent back. Responses are streamed through as they arrive
(server-sent events stay live); bodies are kept for the assertions and the report.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

# Per-connection headers a proxy must not forward (RFC 9110 section 7.6.1).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
KEEP_RESPONSE_BYTES = 4 << 20  # enough for any test session; the rest is counted, not kept
UPSTREAM_TIMEOUT_S = 600.0


@dataclass(slots=True)
class Exchange:
    """One request the agent sent and what the server answered."""

    method: str
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes
    status: int = 0  # 0: the server never answered
    response_headers: dict[str, str] = field(default_factory=dict)
    response: bytearray = field(default_factory=bytearray)
    response_bytes: int = 0
    seconds: float = 0.0

    def json_body(self) -> Any:
        return json.loads(self.body) if self.body else None

    def summary(self) -> str:
        kind = self.headers.get("content-type", "-")
        return (
            f"{self.method} {self.path} -> {self.status} ({len(self.body)} B {kind} in, "
            f"{self.response_bytes} B out, {self.seconds:.1f} s)"
        )


class RecordingProxy:
    """``with RecordingProxy("http://127.0.0.1:PORT") as proxy:`` agents use ``proxy.url``."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname and parts.port, upstream
        self._upstream = (parts.hostname, parts.port)
        self._lock = threading.Lock()
        self._exchanges: list[Exchange] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def exchanges(self) -> list[Exchange]:
        with self._lock:
            return list(self._exchanges)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def _record(self, exchange: Exchange) -> None:
        with self._lock:
            self._exchanges.append(exchange)

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the agents' HTTP clients expect

            def log_message(self, format: str, *args: object) -> None:
                pass  # the exchanges are the log

            def do_GET(self) -> None:
                self._forward()

            do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

            def _read_body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    return b"".join(_read_chunks(self.rfile))
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _forward(self) -> None:
                started = time.monotonic()
                headers = {k.lower(): v for k, v in self.headers.items()}
                exchange = Exchange(self.command, self.path, headers, self._read_body())
                proxy._record(exchange)
                upstream = http.client.HTTPConnection(*proxy._upstream, timeout=UPSTREAM_TIMEOUT_S)
                try:
                    forwarded = {
                        k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP
                    }
                    forwarded["Host"] = "{}:{}".format(*proxy._upstream)
                    forwarded["Content-Length"] = str(len(exchange.body))
                    upstream.request(self.command, self.path, exchange.body, forwarded)
                    reply = upstream.getresponse()
                    exchange.status = reply.status
                    exchange.response_headers = {k.lower(): v for k, v in reply.getheaders()}
                    self._relay(reply, exchange)
                except (BrokenPipeError, ConnectionResetError) as exc:
                    if exchange.status == 0:  # the server hung up: the agent gets a 502
                        self._bad_gateway(exc)
                    self.close_connection = True  # else the agent hung up mid-response
                except OSError as exc:  # no server there, or it timed out
                    self._bad_gateway(exc)
                finally:
                    upstream.close()
                    exchange.seconds = time.monotonic() - started

            def _bad_gateway(self, exc: OSError) -> None:
                body = f"recording proxy: no answer from the server: {exc!r}".encode()
                with contextlib.suppress(OSError):
                    self.send_response_only(502)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                self.close_connection = True

            def _relay(self, reply: http.client.HTTPResponse, exchange: Exchange) -> None:
                self.send_response_only(reply.status, reply.reason)
                length = reply.getheader("Content-Length")
                for name, value in reply.getheaders():
                    if name.lower() not in HOP_BY_HOP:
                        self.send_header(name, value)
                chunked = length is None and self.command != "HEAD"
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while self.command != "HEAD":
                    data = reply.read1(65536)
                    if not data:
                        break
                    exchange.response_bytes += len(data)
                    if len(exchange.response) < KEEP_RESPONSE_BYTES:
                        exchange.response += data
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                    self.wfile.flush()
                if chunked:
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()

        return Handler


def _read_chunks(rfile: Any) -> Iterator[bytes]:
    """The data of a chunked request body (chunk extensions and trailers dropped)."""
    while True:
        size = int(rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return
        yield rfile.read(size)
        rfile.readline()
