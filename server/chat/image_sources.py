"""An image part's URL -> its encoded bytes: ``data:`` URLs always, ``http(s)`` for
the hosts an operator allows.

``data:image/...;base64,...`` is decoded after its length is checked against the
byte limit (the encoded length bounds the decoded one). A remote URL is fetched
only when its host is one of ``--allowed-media-domains`` (exact, case-blind
names; none by default: a URL is then a 400 naming the flag), with httpx's async
client on the event loop's I/O (never blocking it), under the byte limit (the
body is read in chunks and dropped past it) and ``--media-fetch-timeout`` for
the whole download. Redirects are followed by hand, at most ``MAX_REDIRECTS``,
each target checked against the same list, so an allowed host cannot bounce the
server to one that is not.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx

from server.http.errors import APIError

MAX_REDIRECTS = 3
ALLOWED_FLAG = "--allowed-media-domains"


@dataclass(frozen=True, slots=True)
class ImageSource:
    """One image part: where it is in the request (``param``) and its URL."""

    param: str
    url: str

    @property
    def is_data(self) -> bool:
        return self.url[:5].lower() == "data:"


def image_error(param: str, message: str) -> APIError:
    """A 400 naming the image part (``code`` is the type, as DeepSeek's errors)."""
    return APIError(400, f"{param}: {message}", param=param)


def decode_data_url(source: ImageSource, max_bytes: int) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL (400 for any other shape, or too large)."""
    head, comma, payload = source.url.partition(",")
    meta = head[5:].lower().split(";")
    if not comma or "base64" not in meta[1:]:
        raise image_error(source.param, "a data URL must be 'data:image/<type>;base64,<data>'")
    if not meta[0].startswith("image/"):
        raise image_error(source.param, f"a data URL of type '{meta[0][:40]}' is not an image")
    payload = payload.strip()
    if len(payload) // 4 * 3 > max_bytes + 2:  # before decoding: base64 is 4 chars per 3 bytes
        raise too_many_bytes(source.param, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise image_error(source.param, "the data URL's base64 is invalid") from None
    if len(data) > max_bytes:
        raise too_many_bytes(source.param, max_bytes)
    return data


def too_many_bytes(param: str, max_bytes: int) -> APIError:
    return image_error(param, f"the image is larger than {max_bytes} bytes")


def check_host(source: ImageSource, url: str, allowed: tuple[str, ...]) -> None:
    """400 unless ``url`` is http(s) on an allowed host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise image_error(source.param, "an image URL must be a data: or http(s) URL")
    if not allowed:
        raise image_error(
            source.param,
            f"this server fetches no image URLs (the operator allows hosts with "
            f"{ALLOWED_FLAG}); send the image as a data: URL",
        )
    host = (parts.hostname or "").lower()
    if host not in allowed:
        raise image_error(source.param, f"host '{host[:100]}' is not in {ALLOWED_FLAG}")


async def fetch_image(
    client: httpx.AsyncClient,
    source: ImageSource,
    allowed: tuple[str, ...],
    max_bytes: int,
    timeout_s: float,
) -> bytes:
    """The body at ``source.url`` (redirects checked hop by hop); 400 for any failure."""
    try:
        return await asyncio.wait_for(_download(client, source, allowed, max_bytes), timeout_s)
    except TimeoutError:
        raise image_error(
            source.param, f"fetching the image took longer than {timeout_s:g} s"
        ) from None
    except httpx.HTTPError as exc:
        raise image_error(
            source.param, f"fetching the image failed: {type(exc).__name__}"
        ) from None


async def _download(
    client: httpx.AsyncClient, source: ImageSource, allowed: tuple[str, ...], max_bytes: int
) -> bytes:
    url = source.url
    for _ in range(MAX_REDIRECTS + 1):
        check_host(source, url, allowed)
        async with client.stream("GET", url, follow_redirects=False) as response:
            if response.is_redirect:
                url = urljoin(url, response.headers.get("location", ""))
                continue
            if response.status_code != 200:
                raise image_error(
                    source.param, f"fetching the image answered HTTP {response.status_code}"
                )
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise too_many_bytes(source.param, max_bytes)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise too_many_bytes(source.param, max_bytes)
            return bytes(body)
    raise image_error(source.param, f"more than {MAX_REDIRECTS} redirects")


async def fetch_remote_images(
    sources: list[ImageSource], allowed: tuple[str, ...], max_bytes: int, timeout_s: float
) -> dict[str, bytes]:
    """The bytes of every non-``data:`` source, by ``param`` (fetched concurrently)."""
    remote = [s for s in sources if not s.is_data]
    if not remote:
        return {}
    for source in remote:  # refuse a disallowed host before any connection
        check_host(source, source.url, allowed)
    try:
        # A failed download cancels the others (the request is refused anyway).
        async with httpx.AsyncClient(trust_env=False) as client, asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(fetch_image(client, s, allowed, max_bytes, timeout_s))
                for s in remote
            ]
    except ExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return {s.param: t.result() for s, t in zip(remote, tasks, strict=True)}
