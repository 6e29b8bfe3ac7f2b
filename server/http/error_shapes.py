"""Which API's error shape a failed request gets, chosen by its path.

The server raises one ``APIError`` for a failure whatever the API. Its body is
the OpenAI/DeepSeek ``{"error": {...}}`` unless the request's path belongs to
an API with a shape of its own (the Messages API under ``/anthropic/`` and
``/v1/messages``); the error handlers, the body-size limit and the shutdown
reply all ask ``render_error``, so a 401, a 404, a 413 or a 503 of that API
reads the same as its validation errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from server.http.errors import APIError


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """An API's error shape: the paths it owns and how it writes an ``APIError``."""

    prefixes: tuple[str, ...]
    render: Callable[[APIError], tuple[int, dict[str, Any]]]  # -> (status, body)

    def owns(self, path: str) -> bool:
        return path.startswith(self.prefixes)


def render_error(
    error: APIError, path: str, shapes: Sequence[ErrorShape] = ()
) -> tuple[int, dict[str, Any]]:
    """(status, body) of ``error`` for a request to ``path``."""
    for shape in shapes:
        if shape.owns(path):
            return shape.render(error)
    return error.status, error.body()
