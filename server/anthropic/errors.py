"""Anthropic's error shape for every failure of a Messages API request.

``{"type": "error", "error": {"type": ..., "message": ...}}``. The server raises
one ``APIError`` for a failure whatever the API; this is where a request under
``/anthropic/`` or ``/v1/messages`` gets it in Anthropic's words: the body
shape, the error type, and Anthropic's status codes (a 422 "invalid parameters"
of the chat path is Anthropic's 400 ``invalid_request_error``). A 503 (engine
not running, the server shutting down) stays a 503 with ``overloaded_error``:
Anthropic's own overload status is 529, which load balancers do not know, and the
SDKs retry both.
"""

from __future__ import annotations

from typing import Any

from server.http.error_shapes import ErrorShape
from server.http.errors import APIError

PATH_PREFIXES = ("/anthropic/", "/v1/messages")

INVALID_REQUEST = "invalid_request_error"
# status -> (Anthropic's status, Anthropic's type)
_BY_STATUS: dict[int, tuple[int, str]] = {
    400: (400, INVALID_REQUEST),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    405: (405, INVALID_REQUEST),
    408: (408, INVALID_REQUEST),
    413: (413, "request_too_large"),
    422: (400, INVALID_REQUEST),
    429: (429, "rate_limit_error"),
    500: (500, "api_error"),
    503: (503, "overloaded_error"),
}


def anthropic_status(error: APIError) -> tuple[int, str]:
    """(HTTP status, Anthropic error type) of ``error``."""
    if error.status in _BY_STATUS:
        return _BY_STATUS[error.status]
    return (error.status, "api_error" if error.status >= 500 else INVALID_REQUEST)


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    _, kind = anthropic_status(error)
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _render(error: APIError) -> tuple[int, dict[str, Any]]:
    return anthropic_status(error)[0], anthropic_error_body(error)


ANTHROPIC_ERRORS = ErrorShape(prefixes=PATH_PREFIXES, render=_render)
