"""Image URLs: data URLs decoded under the byte cap, http(s) fetched only from allowed
hosts (redirects checked at every hop), under the byte cap and the timeout; a loopback
HTTP server plays the image host."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from image_helpers import data_url, png

from server.chat.image_sources import ImageSource, decode_data_url, fetch_remote_images
from server.http.errors import APIError

IMAGE = png(20, 16)


class _Host(BaseHTTPRequestHandler):
    hits: list[str] = []  # noqa: RUF012 (the test reads it)

    def do_GET(self) -> None:
        _Host.hits.append(self.path)
        if self.path == "/img.png":
            self._send(200, IMAGE)
        elif self.path == "/hop":
            self._redirect("/img.png")
        elif self.path == "/away":
            self._redirect(f"http://localhost:{self.server.server_port}/img.png")
        elif self.path == "/loop":
            self._redirect("/loop")
        elif self.path == "/big":
            self._send(200, b"x" * 5000)
        elif self.path == "/big-chunked":
            self.send_response(200)
            self.end_headers()  # no length: read until the connection closes
            for _ in range(50):
                self.wfile.write(b"x" * 1000)
            self.close_connection = True
        elif self.path == "/slow":
            time.sleep(3)
            self._send(200, IMAGE)
        else:
            self._send(404, b"")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where: str) -> None:
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that stopped reading (the byte cap) breaks the pipe: expected


@pytest.fixture(scope="module")
def host() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Host)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _fetch(url: str, allowed: tuple[str, ...] = ("127.0.0.1",), **kw: float) -> bytes:
    source = ImageSource("messages[0].content[0]", url)
    got = asyncio.run(
        fetch_remote_images([source], allowed, int(kw.get("max_bytes", 4096)), kw.get("timeout", 5))
    )
    return got[source.param]


def _refusal(url: str, **kw: object) -> APIError:
    with pytest.raises(APIError) as info:
        _fetch(url, **kw)  # type: ignore[arg-type]
    assert info.value.status == 400 and info.value.param == "messages[0].content[0]"
    return info.value


def test_allowed_hosts_are_fetched_redirects_included(host: str) -> None:
    assert _fetch(host + "/img.png") == IMAGE
    assert _fetch(host + "/hop") == IMAGE


def test_no_allowed_hosts_means_no_connection(host: str) -> None:
    before = len(_Host.hits)
    error = _refusal(host + "/img.png", allowed=())
    assert "fetches no image URLs" in error.message and "--allowed-media-domains" in error.message
    error = _refusal(host + "/img.png", allowed=("images.example.com",))
    assert "'127.0.0.1' is not in --allowed-media-domains" in error.message
    assert len(_Host.hits) == before


def test_a_redirect_to_another_host_is_refused(host: str) -> None:
    error = _refusal(host + "/away")
    assert "'localhost' is not in" in error.message
    assert "redirects" in _refusal(host + "/loop").message


def test_the_byte_cap_holds_with_or_without_a_length(host: str) -> None:
    assert "larger than 4096 bytes" in _refusal(host + "/big").message
    assert "larger than 20000 bytes" in _refusal(host + "/big-chunked", max_bytes=20_000).message


def test_a_slow_host_times_out(host: str) -> None:
    start = time.monotonic()
    error = _refusal(host + "/slow", timeout=0.3)
    assert time.monotonic() - start < 2 and "longer than 0.3 s" in error.message


def test_an_error_status_is_a_400(host: str) -> None:
    assert "HTTP 404" in _refusal(host + "/missing").message


def test_data_urls_are_measured_before_decoding() -> None:
    source = ImageSource("p", data_url(IMAGE))
    assert decode_data_url(source, len(IMAGE)) == IMAGE
    with pytest.raises(APIError, match="larger than"):
        decode_data_url(source, len(IMAGE) - 1)
    # Upper-case scheme and extra parameters are still a data URL.
    upper = ImageSource("p", data_url(IMAGE).replace("data:image/png;", "DATA:image/png;x=1;"))
    assert upper.is_data and decode_data_url(upper, 10_000) == IMAGE
