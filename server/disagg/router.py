"""The front end of a split deployment (``flashserve serve --role router``).

For each API request the router:

1. posts the body, unchanged, to a prefill worker's internal route
   (``server/disagg/prefill_worker.py``), which returns once the prompt's full KV
   pages are durable in the shared SSD tier;
2. posts the same body to a decode worker's public route with the
   ``x-flashserve-handover`` header (``server/disagg/handover.py``) and its arrival
   time (``x-flashserve-arrived-at``: the decode worker's TTFT counts from
   it); the decode worker restores the pages by its own prefix lookup,
   replays the last window, prefills the partial last page and generates;
3. streams the decode worker's response back byte for byte (SSE or JSON,
   status and error bodies included).

The Messages API's routes (``DECODE_ROUTES``) skip step 1: their body goes
straight to a decode worker, which prefills it.

A prefill call that times out or fails (the worker died, the connection was
cut, a 5xx) is a fallback, counted by reason: the request still goes to a
decode worker, which computes whatever is missing. A request the prefill
worker rejects as invalid (4xx) goes on too, so the client gets the decode
worker's answer for it. The router holds no model and no KV: it
authenticates the API key and forwards the ``Authorization`` (or ``x-api-key``) header, so the
workers derive the same tenant salt (give them the same keys).
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated

import httpx
from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import ValidationError

from server.anthropic.errors import ANTHROPIC_ERRORS
from server.disagg.handover import (
    ARRIVAL_HEADER,
    DECODE_ROUTES,
    HANDOVER_HEADER,
    PREFILL_ROUTES,
    Handover,
)
from server.disagg.prefill_worker import PrefillResponse
from server.disagg.settings import RouterSettings
from server.disagg.worker_pool import WorkerPool, session_key
from server.http.auth import api_key_dependency, x_api_key_dependency
from server.http.body_limit import BodySizeLimit
from server.http.error_handlers import install_error_handlers
from server.http.errors import server_error, unavailable
from server.http.shutdown import QuietCancel
from server.http.sse import DONE, MEDIA_TYPE, WatchedStreamingResponse, event
from server.metrics.metrics import CONTENT_TYPE, ServerMetrics
from server.openai.model_routes import add_model_routes
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

# Response headers worth passing on from a decode worker (not hop-by-hop ones,
# and not content-length: the router re-streams the body).
_PASSED_HEADERS = ("content-type", "cache-control", "x-accel-buffering", "retry-after")


@dataclass(slots=True)
class Upstreams:
    """The router's two pools and its one HTTP client: the calls a request makes."""

    router: RouterSettings
    metrics: ServerMetrics
    client: httpx.AsyncClient
    prefill_pool: WorkerPool
    decode_pool: WorkerPool

    async def prefill(
        self, path: str, body: bytes, headers: dict[str, str], session: bytes | None
    ) -> Handover | None:
        """Publish the prompt's pages through a prefill worker; None on any failure."""
        url = self.prefill_pool.order(session)[0]
        timeout = httpx.Timeout(
            self.router.prefill_timeout_s, connect=self.router.connect_timeout_s
        )
        disagg = self.metrics.disagg
        started = time.monotonic()
        self.prefill_pool.acquire(url)
        try:
            reply = await self.client.post(
                url + PREFILL_ROUTES[path], content=body, headers=headers, timeout=timeout
            )
        except httpx.TimeoutException:
            logger.warning("prefill worker %s timed out; the decode worker prefills", url)
            disagg.fallback("prefill_timeout")
            return None
        except httpx.HTTPError as exc:
            logger.warning("prefill worker %s failed (%r); the decode worker prefills", url, exc)
            disagg.fallback("prefill_error")
            return None
        finally:
            self.prefill_pool.release(url)
            disagg.prefill_seconds.observe(time.monotonic() - started)
        if reply.status_code == 200:
            try:
                published = PrefillResponse.model_validate_json(reply.content)
            except ValidationError:
                disagg.fallback("prefill_error")
                return None
            pages = tuple(p.published_pages for p in published.prompts)
            hits = tuple(p.hit_tokens for p in published.prompts)
            return Handover(pages, published.published_at, hits)
        if reply.status_code >= 500 or reply.status_code == 429:
            logger.warning("prefill worker %s answered %d", url, reply.status_code)
            disagg.fallback("prefill_error")
        # Other 4xx: the request is bad; the decode worker gives the client its error.
        return None

    async def decode(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        handover: Handover | None,
        session: bytes | None,
        arrived_at: float,
    ) -> Response:
        headers = {**headers, ARRIVAL_HEADER: repr(arrived_at)}
        if handover is not None:
            headers[HANDOVER_HEADER] = handover.header()
        timeout = httpx.Timeout(self.router.decode_timeout_s, connect=self.router.connect_timeout_s)
        # The next worker only if this one cannot be reached.
        for url in self.decode_pool.order(session):
            request = self.client.build_request(
                "POST", url + path, content=body, headers=headers, timeout=timeout
            )
            self.decode_pool.acquire(url)
            try:
                upstream = await self.client.send(request, stream=True)
            except httpx.ConnectError as exc:
                self.decode_pool.release(url)
                logger.warning("decode worker %s unreachable: %r", url, exc)
                continue
            except httpx.HTTPError as exc:
                self.decode_pool.release(url)
                raise unavailable(f"The decode worker failed: {exc!r}") from exc
            return _relay(upstream, functools.partial(self.decode_pool.release, url))
        raise unavailable("No decode worker could be reached")

    async def health(self) -> dict[str, str | int]:
        """200 while at least one decode worker is healthy (a dead prefill pool only
        costs fallbacks)."""

        async def ok(url: str) -> bool:
            try:
                reply = await self.client.get(
                    url + "/health", timeout=self.router.connect_timeout_s
                )
            except httpx.HTTPError:
                return False
            return reply.status_code == 200

        urls = self.prefill_pool.urls + self.decode_pool.urls
        checks = await asyncio.gather(*(ok(u) for u in urls))
        n = len(self.prefill_pool.urls)
        prefill_ok, decode_ok = sum(checks[:n]), sum(checks[n:])
        if decode_ok == 0:
            raise unavailable("No decode worker is healthy")
        return {"status": "ok", "prefill_workers": prefill_ok, "decode_workers": decode_ok}


def create_router_app(
    settings: ServerSettings,
    router: RouterSettings,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The public API of a split deployment; ``transport``: for tests."""
    metrics = ServerMetrics(settings.served_model_name, role="router")
    prefill_pool, decode_pool = (
        WorkerPool(urls, router.routing, router.affinity_slack)
        for urls in (router.prefill_urls, router.decode_urls)
    )
    client = httpx.AsyncClient(transport=transport, timeout=router.decode_timeout_s)
    upstreams = Upstreams(router, metrics, client, prefill_pool, decode_pool)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="flashserve router", lifespan=lifespan)
    shapes = (ANTHROPIC_ERRORS,)  # the router's own failures on Messages paths, in its shape
    install_error_handlers(app, shapes)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        read_timeout_s=settings.body_read_timeout_s,
        shapes=shapes,
    )
    app.add_middleware(QuietCancel, shapes=shapes)  # what uvicorn cancels at shutdown: no traceback
    auth = api_key_dependency(settings.api_keys)

    async def forward(request: HttpRequest) -> Response:
        arrived_at = time.time()
        body = await request.body()
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        for name in ("authorization", "x-api-key"):
            if name in request.headers:
                headers[name] = request.headers[name]
        key = headers.get("authorization") or headers.get("x-api-key")
        session = session_key(body, key)
        path = request.url.path
        handover = None
        if path in PREFILL_ROUTES:
            handover = await upstreams.prefill(path, body, headers, session)
        return await upstreams.decode(path, body, headers, handover, session, arrived_at)

    async def proxy(request: HttpRequest, _: Annotated[str | None, Depends(auth)]) -> Response:
        return await forward(request)

    # The Messages API authenticates by x-api-key too, as its own server does.
    messages_auth = x_api_key_dependency(settings.api_keys)

    async def proxy_messages(
        request: HttpRequest, _: Annotated[str | None, Depends(messages_auth)]
    ) -> Response:
        return await forward(request)

    for path in PREFILL_ROUTES:
        app.add_api_route(path, proxy, methods=["POST"], response_model=None)
    for path in DECODE_ROUTES:
        app.add_api_route(path, proxy_messages, methods=["POST"], response_model=None)

    async def hello() -> dict[str, str]:  # Claude Code's reachability check, as a worker's
        return {}

    app.add_api_route("/anthropic/api/hello", hello, methods=["GET", "HEAD"])

    add_model_routes(app, settings.served_model_name, auth)

    @app.get("/health")
    async def health() -> dict[str, str | int]:
        """200 while at least one decode worker is healthy (a dead prefill pool only
        costs fallbacks)."""
        return await upstreams.health()

    @app.get("/metrics", response_class=Response)
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _relay(upstream: httpx.Response, release: Callable[[], None]) -> Response:
    """The decode worker's response, streamed on; closing it (the client left, or the
    end) closes the upstream connection, which makes the decode worker abort."""
    sse = upstream.headers.get("content-type", "").startswith(MEDIA_TYPE)

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_bytes():  # decoded: no content-encoding passed on
                yield chunk
        except httpx.HTTPError as exc:  # the decode worker died or stalled mid-answer
            logger.warning("decode worker stream failed: %r", exc)
            if sse:
                yield b"\n\n" + event(server_error().body()) + DONE

    async def close() -> None:
        await upstream.aclose()
        release()

    headers = {k: upstream.headers[k] for k in _PASSED_HEADERS if k in upstream.headers}
    return WatchedStreamingResponse(
        body(), status_code=upstream.status_code, headers=headers, on_close=close
    )
