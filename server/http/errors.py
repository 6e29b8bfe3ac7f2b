"""The API's one error shape and the status codes DeepSeek documents.

Every failure leaves the server as
``{"error": {"message", "type", "param", "code"}}``. DeepSeek's own errors put the
type in ``code`` as well (``"code": "invalid_request_error"``), so we do too
unless a caller names a more specific code.

Status codes (api-docs.deepseek.com, "Error Codes"): 400 invalid format,
401 authentication fails, 402 insufficient balance (never sent here),
422 invalid parameters, 429 rate limit / overload, 500 server error,
503 server overloaded. We add 413 for a body over the size limit.

What the engine raises is typed (``engine/api/errors.py``); ``from_engine_error``
is the one place those types become status codes, and the one place the
engine's field names become the API's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.api.errors import EngineDeadError, GrammarError, RequestError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"

_TYPE_BY_STATUS = {
    400: INVALID_REQUEST,
    401: AUTHENTICATION,
    404: INVALID_REQUEST,
    413: INVALID_REQUEST,
    422: INVALID_REQUEST,
    429: RATE_LIMIT,
    500: SERVER_ERROR,
    503: UNAVAILABLE,
}

# pydantic error types that mean "a well-formed value outside its allowed range"
# (422 invalid parameters); every other failure means the body does not have the
# documented shape (400 invalid format).
_RANGE_ERROR_TYPES = frozenset(
    {
        "greater_than",
        "greater_than_equal",
        "less_than",
        "less_than_equal",
        "too_long",
        "too_short",
        "multiple_of",
        "finite_number",
        "invalid_parameter",  # our own PydanticCustomError type for range-like checks
    }
)

# Location segments pydantic adds for union members and validator wrappers; they
# are not field names, so they never appear in the `param` we report.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


class APIError(Exception):
    """A request that fails with an HTTP status and the API error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(
            status, SERVER_ERROR if status >= 500 else INVALID_REQUEST
        )
        self.param = param
        self.code = code or self.type

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code or type}}


def invalid_request(message: str, param: str | None = None) -> APIError:
    """400: the body is not what the endpoint takes (DeepSeek "Invalid Format")."""
    return APIError(400, message, param=param)


def invalid_parameter(message: str, param: str | None = None) -> APIError:
    """422: a parameter's value is out of its allowed range (DeepSeek "Invalid Parameters")."""
    return APIError(422, message, param=param)


def authentication_failed(api_key: str | None) -> APIError:
    """401 with DeepSeek's wording; only the key's last four characters are echoed."""
    shown = f"****{api_key[-4:]}" if api_key and len(api_key) > 8 else "****"
    return APIError(401, f"Authentication Fails, Your api key: {shown} is invalid")


def request_too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit_bytes} bytes")


def overloaded(message: str = "Server is busy: the request queue is full; retry later") -> APIError:
    """429: the engine's queue is full."""
    return APIError(429, message)


def server_error(
    message: str = "The server had an error while processing your request",
) -> APIError:
    return APIError(500, message)


def unavailable(message: str = "The server is overloaded or not ready; retry later") -> APIError:
    return APIError(503, message)


def shutting_down() -> APIError:
    """503: the server is stopping and ends the request it could not finish in time (a
    client retries it elsewhere); one fresh error per request, each API frames its own."""
    return APIError(503, "The server is shutting down; retry the request")


# The engine's name for the prompt (``Request.prompt_token_ids``); each front end
# names its own prompt field (chat: ``messages``, completions: ``prompt``).
ENGINE_PROMPT = "prompt_token_ids"


def from_engine_error(exc: BaseException, prompt_param: str = "messages") -> APIError:
    """The API error for an exception out of the engine (``prompt_param``: what the front
    end calls the prompt).

    A ``RequestError`` naming the prompt, or none, is a 400 (the prompt cannot fit, the
    request as a whole cannot run); one naming a sampling field is a 422 (a value out of
    its range). ``EngineDeadError`` is a 503; anything else is a bug: a 500, logged."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, GrammarError):  # the engine could not build the request's grammar
        return APIError(exc.status, exc.message, param=exc.param)
    if isinstance(exc, RequestError):
        if exc.param is None:
            return invalid_request(exc.message)
        if exc.param == ENGINE_PROMPT:
            return invalid_request(f"{prompt_param}: {exc.message}", prompt_param)
        return invalid_parameter(str(exc), exc.param)
    if isinstance(exc, EngineDeadError):
        # Its text names the failed step's exception: for the log, not the client.
        logger.warning("request refused: %s", exc)
        return unavailable("The engine is not running")
    logger.error("engine request failed", exc_info=exc)
    return server_error()


def format_loc(loc: Iterable[int | str]) -> str | None:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``, without union tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if _is_type_tag(part):
            continue
        out += f".{part}" if out else part
    return out or None


def _is_type_tag(part: str) -> bool:
    # Union members show up as "str", "list[...]", "function-after[...]",
    # "literal['a','b']" or a model class name; our field names are snake_case.
    return (
        part in _TYPE_TAGS
        or any(c in part for c in "[]()'\", -")
        or (part[:1].isupper() and part.isidentifier())
    )


def from_validation_errors(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """One ``APIError`` for a list of pydantic (or FastAPI) validation errors.

    The deepest error wins: for a union, the member that matched furthest names
    the real problem (e.g. the image part inside a content list). FastAPI puts
    ``"body"`` first in each location; it is dropped.
    """
    if not errors:
        return invalid_request("Invalid request body")
    best = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = tuple(best.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    kind = str(best.get("type", ""))
    message = str(best.get("msg", "invalid value"))
    if kind == "json_invalid":
        return invalid_request(f"Failed to parse the request body as JSON: {message}")
    param = format_loc(loc)
    if kind == "missing" and param:
        text = f"{param}: field required"
    else:
        text = f"{param}: {message}" if param else message
    status = 422 if kind in _RANGE_ERROR_TYPES else 400
    return APIError(status, text, param=param)
