"""``/openapi.json`` and ``/docs`` behind the API keys.

FastAPI serves both without authentication; a server with keys would then show
anyone its routes, limits and version. These routes take the same dependency
as the API (no keys configured: open, as before). With keys, the Swagger UI
page loads but its schema fetch needs the key, so read the schema with
``curl -H "Authorization: Bearer KEY" .../openapi.json``.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse


def add_docs_routes(app: FastAPI, auth: Callable[..., Any]) -> None:
    async def openapi(_: Annotated[str | None, Depends(auth)]) -> JSONResponse:
        return JSONResponse(app.openapi())

    async def docs(_: Annotated[str | None, Depends(auth)]) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    app.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)
    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)
