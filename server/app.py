"""The FastAPI app: routes, authentication, the body limit and the one error shape.

``create_app(engine, settings)`` is the whole HTTP surface of a server with an
engine; ``flashserve serve`` runs it under uvicorn. Routes are thin: chat and
completions live in ``serving_chat`` and ``serving_completions``, the Messages
API in ``server/anthropic/``. A prefill
worker (``settings.role == "prefill"``) serves ``prefill_worker``'s internal
routes instead of the API; a router has no engine and its own app
(``server/disagg/router.py``). Every failure, including
FastAPI's own (validation, unknown path, wrong method) and any bug, leaves as
``{"error": {...}}`` with DeepSeek's status codes.

Stopping: ``end_open_requests`` ends every request still running with a 503 of
its API (the drain's end, called by ``flashserve serve``), and ``QuietCancel``
answers whatever uvicorn cancels after that without a traceback.
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at
# runtime, and their dependencies (``auth``) are local to ``create_app``.
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response

from engine.api.protocol import EngineClient
from server.anthropic.errors import ANTHROPIC_ERRORS
from server.anthropic.routes import add_messages_routes
from server.disagg.prefill_worker import add_prefill_routes
from server.http.auth import api_key_dependency
from server.http.body_limit import BodySizeLimit
from server.http.docs_routes import add_docs_routes
from server.http.error_handlers import install_error_handlers
from server.http.errors import unavailable
from server.http.shutdown import QuietCancel
from server.http.sse import MEDIA_TYPE
from server.metrics.metrics import CONTENT_TYPE, ServerMetrics
from server.openai.generation import Admission, ServingContext
from server.openai.logprobs import TokenTexts
from server.openai.model_routes import add_model_routes
from server.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
)
from server.openai.serving_chat import create_chat_completion
from server.openai.serving_completions import create_completion
from server.playground.routes import add_playground_routes
from server.settings import ServerSettings

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid format"},
    401: {"model": ErrorResponse, "description": "Authentication fails"},
    413: {"model": ErrorResponse, "description": "Request body too large"},
    422: {"model": ErrorResponse, "description": "Invalid parameters"},
    429: {"model": ErrorResponse, "description": "Request queue full"},
    500: {"model": ErrorResponse, "description": "Server error"},
    503: {"model": ErrorResponse, "description": "Engine not running"},
}


def _stream_or(model: type) -> dict[int | str, dict[str, Any]]:
    """Responses of an endpoint answering JSON, or SSE when ``stream`` is true."""
    ok = {"model": model, "content": {MEDIA_TYPE: {"schema": {"type": "string"}}}}
    return {200: ok, **_ERRORS}


def _version() -> str:
    try:
        return version("flashserve")
    except PackageNotFoundError:
        return "0.0.0"


def create_app(engine: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    """The API over ``engine``; the caller starts and shuts down the engine."""
    settings = settings or ServerSettings()
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise ValueError("the server needs an engine with a tokenizer")
    ctx = ServingContext(
        engine=engine,
        settings=settings,
        metrics=ServerMetrics(
            settings.served_model_name,
            role=settings.role,
            vllm_aliases=settings.vllm_metric_aliases,
        ),
        tokenizer=tokenizer,
        token_texts=TokenTexts(tokenizer),
        admission=Admission(settings.max_concurrent_requests, settings.max_concurrent_sequences),
        pool=ThreadPoolExecutor(settings.preprocess_workers, thread_name_prefix="preprocess"),
        vision=engine.vision,
    )
    # The schema and its UI are served by routes of our own, behind the API keys.
    app = FastAPI(
        title="flashserve",
        version=_version(),
        summary="OpenAI- and DeepSeek-compatible API for DeepSeek-V4.1-Flash",
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.serving = ctx
    # Each API's paths get its error shape (the Messages API's own; else OpenAI's).
    shapes = (ANTHROPIC_ERRORS,)
    install_error_handlers(app, shapes)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        read_timeout_s=settings.body_read_timeout_s,
        shapes=shapes,
    )
    app.add_middleware(QuietCancel, shapes=shapes)  # added last: the outermost of ours
    auth = api_key_dependency(settings.api_keys)
    add_docs_routes(app, auth)
    if settings.role == "prefill":
        add_prefill_routes(app, ctx, auth)
    else:
        _add_api_routes(app, ctx, auth)

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health() -> dict[str, str]:
        """200 while the engine (thread or core process) runs and makes progress (no auth).

        503 when it stopped, or when requests are pending and no step has finished for
        ``health_stall_s`` (a wedged engine must fail its liveness probe)."""
        if not engine.is_running:
            raise unavailable("The engine is not running")
        stalled = engine.stalled_for()
        if stalled > settings.health_stall_s:
            raise unavailable(f"The engine has made no progress for {stalled:.0f} s")
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def metrics() -> Response:
        """Prometheus metrics (no authentication; names in docs/metrics.md)."""
        ctx.metrics.set_engine_stats(engine.stats())
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    return app


def end_open_requests(app: FastAPI) -> int:
    """End every request ``app`` is still serving with a 503 "shutting down" in its API's
    shape (a stream: its error event and end marker); how many. An app without an
    engine (the split deployment's router) has none."""
    ctx = getattr(app.state, "serving", None)
    return ctx.open_requests.shut_down() if isinstance(ctx, ServingContext) else 0


def _add_api_routes(app: FastAPI, ctx: ServingContext, auth: Callable[..., Any]) -> None:
    """The OpenAI/DeepSeek API (chat, completions, FIM and models), the Anthropic
    Messages API (server/anthropic/) and the playground at ``/``."""
    settings = ctx.settings

    async def chat_completions(
        body: ChatCompletionRequest,
        request: HttpRequest,
        api_key: Annotated[str | None, Depends(auth)],
    ) -> Response:
        return await create_chat_completion(ctx, body, api_key=api_key, http_request=request)

    async def completions(
        body: CompletionRequest,
        request: HttpRequest,
        api_key: Annotated[str | None, Depends(auth)],
    ) -> Response:
        return await create_completion(ctx, body, api_key=api_key, http_request=request, fim=False)

    async def fim_completions(
        body: CompletionRequest,
        request: HttpRequest,
        api_key: Annotated[str | None, Depends(auth)],
    ) -> Response:
        return await create_completion(ctx, body, api_key=api_key, http_request=request, fim=True)

    # (path, endpoint, operation id); the unversioned aliases stay out of the schema.
    posts: list[tuple[str, Callable[..., Any], str | None, dict[int | str, Any]]] = [
        (
            "/v1/chat/completions",
            chat_completions,
            "create_chat_completion",
            _stream_or(ChatCompletion),
        ),
        (
            "/beta/chat/completions",
            chat_completions,
            "create_beta_chat_completion",
            _stream_or(ChatCompletion),
        ),
        ("/chat/completions", chat_completions, None, _stream_or(ChatCompletion)),
        ("/v1/completions", completions, "create_completion", _stream_or(Completion)),
        ("/completions", completions, None, _stream_or(Completion)),
        ("/beta/completions", fim_completions, "create_fim_completion", _stream_or(Completion)),
    ]
    for path, endpoint, operation_id, responses in posts:
        app.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            response_model=None,
            responses=responses,
            operation_id=operation_id,
            include_in_schema=operation_id is not None,
        )

    add_model_routes(
        app,
        settings.served_model_name,
        auth,
        _ERRORS,
        max_model_len=ctx.engine.max_model_len,
        takes_images=ctx.vision is not None,
    )
    add_messages_routes(app, ctx)
    add_playground_routes(app, enabled=settings.playground)
