"""Exception handlers that give every failure the API's one error shape.

FastAPI's own failures (validation, unknown path, wrong method) and any bug
leave as ``{"error": {...}}`` with DeepSeek's status codes; both the engine
app (``server/app.py``) and the router (``server/disagg/router.py``) install them.
"""

import logging
from collections.abc import Mapping, Sequence

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.http.error_shapes import ErrorShape, render_error
from server.http.errors import APIError, from_validation_errors, server_error

logger = logging.getLogger(__name__)


def install_error_handlers(app: FastAPI, shapes: Sequence[ErrorShape] = ()) -> None:
    """Every failure leaves as ``{"error": {...}}`` (the router's app uses them too), or
    in the shape of the API whose path it was (``shapes``)."""

    def reply(
        request: HttpRequest, error: APIError, headers: Mapping[str, str] | None = None
    ) -> JSONResponse:
        status, body = render_error(error, request.url.path, shapes)
        return JSONResponse(body, status_code=status, headers=headers)

    async def api_error(request: HttpRequest, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return reply(request, exc)

    async def validation_error(request: HttpRequest, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return reply(request, from_validation_errors(exc.errors()))

    async def http_error(request: HttpRequest, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return reply(request, APIError(exc.status_code, str(exc.detail)), exc.headers)

    async def too_deep(request: HttpRequest, exc: Exception) -> JSONResponse:
        # A value nested past what a parser or renderer recurses through; the input's
        # fault, not the server's (the request checks bound depth, this is the backstop).
        logger.warning("recursion limit on %s %s", request.method, request.url.path)
        return reply(request, APIError(400, "The request nests values too deeply"))

    async def unexpected(request: HttpRequest, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return reply(request, server_error())

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RecursionError, too_deep)
    app.add_exception_handler(Exception, unexpected)
