"""The routes of a prefill worker (``flashserve serve --role prefill``).

A router posts the client's request body, unchanged, to the internal route
for its kind. The worker turns it into prompt token ids exactly as the
public endpoint would (same chat template, tokenizer and tenant salt, so the
page hashes match the decode worker's), runs each distinct prompt as a
prefill-only engine request (encoder path over its full pages), waits until
those pages are durable in the shared SSD tier, and answers with how many
pages each prompt published. The decode worker then finds them by its own
prefix lookup (docs/design/disaggregation.md).
"""

# No `from __future__ import annotations`: FastAPI reads the route signatures at runtime.
import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import BaseModel

from engine.api.errors import RequestError
from engine.api.protocol import PrefillResult
from engine.api.request import ImageInput, Request
from engine.api.sampling_params import SamplingParams
from server.chat.chat_plan import fetch_chat_images, plan_chat
from server.http.auth import tenant_salt
from server.http.errors import from_engine_error, unavailable
from server.openai.generation import ClientGone, ServingContext
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.serving_base import CLIENT_CLOSED
from server.openai.serving_completions import completion_prompt_ids


class PublishedPrompt(BaseModel):
    prompt_tokens: int
    published_pages: int  # pages of the prompt's chain durable in the tier, from the first
    hit_tokens: int  # of which this worker already had cached (not computed again)


class PrefillResponse(BaseModel):
    """The answer of a prefill worker; ``published_at`` is its ``time.time()``."""

    prompts: list[PublishedPrompt]
    page_tokens: int
    page_file_bytes: int
    published_at: float


def add_prefill_routes(
    app: FastAPI, ctx: ServingContext, auth: Callable[..., Awaitable[str | None]]
) -> None:
    """``POST /internal/prefill/{chat,completions,fim}`` (kept out of the API schema)."""

    async def chat(
        body: ChatCompletionRequest,
        http: HttpRequest,
        api_key: Annotated[str | None, Depends(auth)],
    ) -> PrefillResponse | Response:
        fetched = await fetch_chat_images(ctx, body)
        calls = (await ctx.offload(plan_chat, ctx, body, api_key, fetched)).calls
        # Choices with grammars of their own share one prompt: prefill it once.
        request = calls[0].request
        ids, salt = [request.prompt_token_ids], request.cache_salt
        return await _publish(
            ctx, ids, salt, "messages", http.is_disconnected, images=[request.images]
        )

    def completions(fim: bool) -> Callable[..., Awaitable[PrefillResponse | Response]]:
        async def endpoint(
            body: CompletionRequest,
            http: HttpRequest,
            api_key: Annotated[str | None, Depends(auth)],
        ) -> PrefillResponse | Response:
            ids = await ctx.offload(completion_prompt_ids, ctx, body, fim)
            salt = tenant_salt(api_key, body.cache_salt)
            return await _publish(ctx, ids, salt, "prompt", http.is_disconnected)

        return endpoint

    for path, endpoint in (
        ("/internal/prefill/chat", chat),
        ("/internal/prefill/completions", completions(fim=False)),
        ("/internal/prefill/fim", completions(fim=True)),
    ):
        app.add_api_route(
            path, endpoint, methods=["POST"], response_model=None, include_in_schema=False
        )


async def _publish(
    ctx: ServingContext,
    prompts: list[list[int]],
    salt: bytes | str,
    prompt_param: str,
    is_disconnected: Callable[[], Awaitable[bool]],
    images: list[list[ImageInput]] | None = None,
) -> PrefillResponse | Response:
    """Prefill and publish every prompt (``images``: each prompt's, as the planner
    placed them); a router that gave up (timed out, or its client left) aborts the
    work, as a client of the public API does."""
    if not ctx.engine.is_running:
        raise unavailable("The engine is not running")
    rid = f"prefill-{uuid.uuid4().hex}"
    requests = [
        Request(
            f"{rid}-{i}",
            ids,
            SamplingParams(max_tokens=1),
            cache_salt=salt,
            prefill_only=True,
            images=images[i] if images else [],
        )
        for i, ids in enumerate(prompts)
    ]
    for r in requests:
        try:
            ctx.engine.validate(r)
        except RequestError as exc:
            raise from_engine_error(exc, prompt_param) from exc
    timeout = ctx.settings.publish_timeout_s
    poll_s = ctx.settings.disconnect_poll_s

    async def watch() -> None:
        while True:
            await asyncio.sleep(poll_s)
            if await is_disconnected():
                raise ClientGone

    ctx.admission.enter()
    try:
        # A failing prompt, or the caller leaving, cancels the rest, which aborts
        # their engine requests.
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(ctx.engine.prefill(r, timeout)) for r in requests]
            watcher = group.create_task(watch())
            await asyncio.gather(*tasks)
            watcher.cancel()
    except ExceptionGroup as failed:
        if failed.subgroup(ClientGone) is not None:
            return Response(status_code=CLIENT_CLOSED)
        raise from_engine_error(failed.exceptions[0], prompt_param) from failed
    finally:
        ctx.admission.leave()
    return _respond(ctx, [t.result() for t in tasks])


def _respond(ctx: ServingContext, results: list[PrefillResult]) -> PrefillResponse:
    m = ctx.metrics.disagg
    for r in results:
        m.published_pages.inc(r.published_pages)
        m.published_bytes.inc(r.published_bytes)
    stats = ctx.engine.stats().kv
    return PrefillResponse(
        prompts=[
            PublishedPrompt(
                prompt_tokens=r.prompt_tokens,
                published_pages=r.published_pages,
                hit_tokens=r.hit_tokens,
            )
            for r in results
        ],
        page_tokens=stats.page_tokens,
        page_file_bytes=stats.ssd.file_bytes,
        published_at=time.time(),
    )
