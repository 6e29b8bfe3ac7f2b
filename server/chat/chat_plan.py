"""A chat request -> its engine calls: prompt, budget, sampling and grammar of each choice.

The one planner of both front ends: ``POST /v1/chat/completions`` plans its body
here, and the Messages API (server/anthropic/) translates its body into the same
chat request first, so the prompt, sampling, forced-call grammars and the
output parser's settings are one code path. A prefill worker of a split
deployment plans here too, so its pages are the ones the decode side will look up.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from engine.api.request import Request
from engine.api.sampling_params import StructuredOutputSpec
from engine.api.special_tokens import DSML, THINK_END, THINK_START
from server.chat.chat_encoding import ASSISTANT, encode_chat, ends_inside_reasoning
from server.chat.chat_images import (
    check_images_allowed,
    image_sources,
    place_images,
    process_images,
)
from server.chat.image_sources import fetch_remote_images
from server.chat.structured_output import structured_output_spec
from server.http.auth import tenant_salt
from server.openai.generation import EngineCall, ServingContext
from server.openai.model_names import default_max_tokens, resolve_model, thinking_enabled
from server.openai.protocol import ChatCompletionRequest, reasoning_budget, resolve_max_tokens
from server.openai.sampling import logit_bias, sampling_params


@dataclass(slots=True)
class ChatPlan:
    """What one chat request turned into."""

    id: str
    created: int
    model: str  # as the client named it
    thinking: bool
    starts_in_reasoning: bool
    parse_tools: bool
    forced_calls: bool  # the grammar makes the answer one calls block
    logprobs: bool
    calls: list[EngineCall]


async def fetch_chat_images(ctx: ServingContext, body: ChatCompletionRequest) -> dict[str, bytes]:
    """The bodies of the request's http(s) image URLs, by part (``plan_chat`` takes them).

    On the event loop, before planning: whether images are taken at all, how many,
    and each URL's host are checked first, so a refused request opens no connection."""
    sources = image_sources(body.messages)
    check_images_allowed(sources, ctx.vision, ctx.settings)
    settings = ctx.settings
    return await fetch_remote_images(
        sources,
        settings.allowed_media_domains,
        settings.max_image_bytes,
        settings.media_fetch_timeout_s,
    )


def plan_chat(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    api_key: str | None,
    fetched: Mapping[str, bytes] | None = None,
) -> ChatPlan:
    """Prompt, sampling and grammar of every choice; raises ``APIError`` for what cannot run.

    ``fetched``: the request's remote images (``fetch_chat_images``); data URLs are
    decoded here. Runs in a planning thread: images are decoded off the event loop."""
    route = resolve_model(body.model, ctx.settings.served_model_name)
    bias = logit_bias(body, ctx.engine.vocab_size)  # cheap checks before the expensive work
    sources = image_sources(body.messages)
    check_images_allowed(sources, ctx.vision, ctx.settings)
    thinking = thinking_enabled(
        route, body.thinking.type if body.thinking else None, body.reasoning_effort
    )
    tool_choice = body.effective_tool_choice
    prompt = encode_chat(
        body.messages,
        tools=body.tools,
        tool_choice=tool_choice,
        thinking=thinking,
        reasoning_effort=reasoning_budget(body.reasoning_effort),
        prefix_completion=body.prefix_completion,
        response_format=body.response_format,
    )
    ids = ctx.encode(prompt, "messages")
    images = []
    if ctx.vision is not None:  # each placeholder becomes its image's span
        processed = process_images(sources, fetched or {}, ctx.vision, ctx.settings)
        placed = place_images(ids, processed, ctx.vision.image_token_id)
        ids, images = placed.prompt_token_ids, placed.images
    max_tokens = resolve_max_tokens(
        body.max_output_tokens,
        len(ids),
        ctx.engine.max_model_len,
        default=default_max_tokens(thinking, ctx.settings.default_max_tokens),
        prompt_param="messages",
    )
    starts_in_reasoning = thinking and ends_inside_reasoning(prompt)
    uses_tools = bool(body.tools) and tool_choice != "none"

    grammar = structured_output_spec(
        ctx.settings.max_grammar_schema_bytes,
        response_format=body.response_format,
        tools=body.tools if uses_tools else None,
        tool_choice=tool_choice if uses_tools else None,
        parallel_tool_calls=body.parallel_tool_calls,
        starts_in_reasoning=starts_in_reasoning,
        prefix=answer_prefix(prompt, starts_in_reasoning) if body.prefix_completion else "",
    )

    # tool_choice "none" with tools listed: the calls block cannot start.
    dsml_id = ctx.tokenizer.token_to_id(DSML)
    banned = [dsml_id] if body.tools and not uses_tools and dsml_id is not None else []
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    salt = tenant_salt(api_key, body.cache_salt)

    def call(k: int, n: int, spec: StructuredOutputSpec | None) -> EngineCall:
        params = sampling_params(
            body,
            max_tokens=max_tokens,
            n=n,
            logprobs=logprobs,
            vocab_size=ctx.engine.vocab_size,
            bias=bias,
            banned=banned,
            seed_offset=k,
            structured=spec,
            prompt_logprobs=body.prompt_logprobs if k == 0 else None,  # one call scores it
        )
        request = Request(f"{request_id}-{k}", ids, params, cache_salt=salt, images=images)
        return EngineCall(request, k)

    if grammar is None:
        calls = [call(0, body.n, None)]
    else:  # one engine request per choice, each with its grammar (compiled once)
        calls = [call(k, 1, grammar) for k in range(body.n)]
    return ChatPlan(
        id=request_id,
        created=int(time.time()),
        model=route.name,
        thinking=thinking,
        starts_in_reasoning=starts_in_reasoning,
        parse_tools=uses_tools,
        forced_calls=forced_calls(grammar),
        logprobs=logprobs is not None,
        calls=calls,
    )


def forced_calls(grammar: StructuredOutputSpec | None) -> bool:
    """Whether the grammar makes the whole answer one calls block (required or named)."""
    return grammar is not None and grammar.tools is not None and grammar.tool_choice != "auto"


def answer_prefix(prompt: str, starts_in_reasoning: bool) -> str:
    """The output text a prefix-completion prompt already holds (what a grammar must accept
    first): the reasoning when it is still open, else the answer after ``</think>``."""
    tail = prompt[prompt.rfind(ASSISTANT) + len(ASSISTANT) :]
    if starts_in_reasoning:
        return tail[tail.rfind(THINK_START) + len(THINK_START) :]
    end = tail.rfind(THINK_END)
    return tail[end + len(THINK_END) :] if end >= 0 else tail
