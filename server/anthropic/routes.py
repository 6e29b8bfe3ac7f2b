"""The Messages API's routes: at DeepSeek's base URL (``/anthropic/v1/...``) and at vLLM's
paths (``/v1/messages``, ``/v1/messages/count_tokens``), plus ``/anthropic/v1/models``
and ``/anthropic/api/hello``, the reachability check Claude Code sends (``HEAD``)
before its first request when it is pointed at a base URL of its own.

Authentication takes ``x-api-key`` (the SDKs) or ``Authorization: Bearer``
(Claude Code's ``ANTHROPIC_AUTH_TOKEN``); the ``anthropic-version`` and
``anthropic-beta`` headers are read by nothing. Every failure under these paths
leaves in Anthropic's error shape (``errors.py``).
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response

from server.anthropic.protocol import (
    AnthropicErrorResponse,
    AnthropicModel,
    AnthropicModelList,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from server.anthropic.serving_messages import count_tokens, create_message
from server.http.auth import x_api_key_dependency
from server.http.sse import MEDIA_TYPE
from server.openai.generation import ServingContext
from server.openai.model_names import model_ids
from server.openai.protocol import input_modalities

BASE = "/anthropic"
# A fixed date: the served model has no release date of its own to report.
MODEL_CREATED_AT = "2026-01-01T00:00:00Z"

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": AnthropicErrorResponse, "description": text}
    for status, text in (
        (400, "Invalid request"),
        (401, "Authentication fails"),
        (413, "Request body too large"),
        (429, "Request queue full"),
        (500, "Server error"),
        (503, "Engine not running or overloaded"),
    )
}


def add_messages_routes(app: FastAPI, ctx: ServingContext) -> None:
    auth: Callable[..., Any] = x_api_key_dependency(ctx.settings.api_keys)

    async def messages(
        body: MessagesRequest,
        request: HttpRequest,
        api_key: Annotated[str | None, Depends(auth)],
    ) -> Response:
        return await create_message(ctx, body, api_key=api_key, http_request=request)

    async def tokens(
        body: CountTokensRequest, api_key: Annotated[str | None, Depends(auth)]
    ) -> CountTokensResponse:
        return await count_tokens(ctx, body, api_key=api_key)

    async def models(_: Annotated[str | None, Depends(auth)]) -> AnthropicModelList:
        ids = model_ids(ctx.settings.served_model_name)
        modalities = input_modalities(ctx.vision is not None)
        data = [
            AnthropicModel(
                id=i, display_name=i, created_at=MODEL_CREATED_AT, input_modalities=modalities
            )
            for i in ids
        ]
        return AnthropicModelList(data=data, first_id=ids[0], last_id=ids[-1])

    async def hello() -> dict[str, str]:
        return {}

    streamed = {
        200: {
            "model": MessageResponse,
            "content": {MEDIA_TYPE: {"schema": {"type": "string"}}},
        },
        **_ERRORS,
    }
    for prefix, in_schema in ((BASE, True), ("", False)):
        app.add_api_route(
            f"{prefix}/v1/messages",
            messages,
            methods=["POST"],
            response_model=None,
            responses=streamed,
            operation_id="create_message" if in_schema else None,
            include_in_schema=in_schema,
        )
        app.add_api_route(
            f"{prefix}/v1/messages/count_tokens",
            tokens,
            methods=["POST"],
            responses=_ERRORS,
            operation_id="count_message_tokens" if in_schema else None,
            include_in_schema=in_schema,
        )
    app.add_api_route(f"{BASE}/v1/models", models, methods=["GET"], responses=_ERRORS)
    # No key needed, as a health check: it says the server is there, nothing more.
    app.add_api_route(f"{BASE}/api/hello", hello, methods=["GET", "HEAD"], include_in_schema=False)
