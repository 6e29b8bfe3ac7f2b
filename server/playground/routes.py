"""``GET /``: the playground page for a browser, a short JSON index for everyone else.

The page (``static/``) is plain HTML, CSS and JavaScript read from the package
at start-up: no build step, no request to another origin. It adds no API of its
own: it calls ``/v1/models`` and ``/v1/chat/completions`` like any client, with
the key typed into it, so ``--api-key`` guards it as it guards every client.
The page and its two assets carry a strict Content-Security-Policy (scripts,
styles and fetches from this origin only; no inline script, no frames, no
forms), and the script writes model output as text, never as HTML.

``--no-playground`` leaves only the JSON index at ``/`` and no asset routes.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

# The page's files, each served at ASSET_PREFIX + name, and their media types.
ASSET_PREFIX = "/playground/"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
PAGE = "index.html"

# default-src 'none': anything not named below (frames, fonts, objects, workers) is refused.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    # The files change with the package, not while it runs; a reload re-checks.
    "Cache-Control": "no-cache",
}

# The API a client can call, for the JSON index (the OpenAPI schema has the details).
API_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/beta/completions",
    "/v1/messages",
    "/anthropic/v1/messages",
    "/v1/models",
    "/health",
    "/metrics",
    "/docs",
    "/openapi.json",
)


@dataclass(frozen=True, slots=True)
class StaticFile:
    body: bytes
    media_type: str


def load_static() -> dict[str, StaticFile]:
    """The page and its assets, read once from the installed package."""
    folder = files("server.playground") / "static"
    media = {PAGE: "text/html; charset=utf-8"}
    media.update({name: f"{kind}; charset=utf-8" for name, kind in ASSETS.items()})
    return {name: StaticFile((folder / name).read_bytes(), kind) for name, kind in media.items()}


def wants_html(accept: str) -> bool:
    """Whether an ``Accept`` header prefers HTML to JSON (a browser's navigation does).

    Media ranges are weighed by their ``q``; a JSON client, a bare ``*/*`` (curl) or no
    header at all gets JSON, so scripts keep a machine-readable answer."""
    html = json = 0.0
    for item in accept.split(","):
        kind, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        kind = kind.lower()
        if kind in ("text/html", "application/xhtml+xml"):
            html = max(html, q)
        elif kind == "application/json":
            json = max(json, q)
    return html > 0 and html >= json


def index(playground: bool) -> dict[str, Any]:
    """What ``/`` tells a JSON client: where the API is. Nothing a client without a key
    should not see (the model name and version are behind the keys, in ``/v1/models``
    and ``/openapi.json``)."""
    return {
        "object": "flashserve.index",
        "openai_base_url": "/v1",
        "endpoints": list(API_PATHS),
        "playground": "/" if playground else None,
    }


def add_playground_routes(app: FastAPI, *, enabled: bool) -> None:
    """``GET /`` (the page or the index) and, when ``enabled``, the page's assets."""
    static = load_static() if enabled else {}
    body = index(enabled)

    async def root(request: HttpRequest) -> Response:
        if enabled and wants_html(request.headers.get("accept", "")):
            page = static[PAGE]
            response: Response = Response(page.body, media_type=page.media_type)
            response.headers.update(SECURITY_HEADERS)
        else:
            response = JSONResponse(body)
        response.headers["Vary"] = "Accept"
        return response

    app.add_api_route("/", root, methods=["GET"], include_in_schema=False)
    for name in ASSETS if enabled else ():
        app.add_api_route(
            ASSET_PREFIX + name, _asset(static[name]), methods=["GET"], include_in_schema=False
        )


def _asset(file: StaticFile) -> Any:
    async def asset() -> Response:
        return Response(file.body, media_type=file.media_type, headers=SECURITY_HEADERS)

    return asset
