"""``POST /v1/chat/completions`` (and ``/chat/completions``, ``/beta/chat/completions``).

messages -> V4.1 prompt -> engine requests -> ``reasoning_content`` / ``content`` /
``tool_calls`` per choice, as one JSON body or as SSE chunks. Chat prefix
completion (a last assistant message with ``prefix: true``) is served at every
path; DeepSeek documents it under ``/beta``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from engine.api.request import Request
from engine.api.sampling_params import StructuredOutputSpec
from engine.api.special_tokens import DSML, THINK_END, THINK_START
from server.chat.chat_encoding import ASSISTANT, encode_chat, ends_inside_reasoning
from server.chat.chat_output import ChatOutputParser
from server.chat.structured_output import structured_output_spec
from server.http.auth import tenant_salt
from server.http.sse import event
from server.openai.generation import ChoiceUpdate, EngineCall, Generation, ServingContext
from server.openai.logprobs import prompt_logprob_entries
from server.openai.model_names import default_max_tokens, resolve_model, thinking_enabled
from server.openai.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChunkChoice,
    PromptLogprob,
    reasoning_budget,
    resolve_max_tokens,
)
from server.openai.protocol import Usage as ApiUsage
from server.openai.sampling import check_fan_out, logit_bias, sampling_params
from server.openai.serving_base import ResponseBuilder, serve


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


async def create_chat_completion(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    *,
    api_key: str | None,
    http_request: HttpRequest,
) -> Response:
    check_fan_out(ctx, body.n, 1)
    # Tokenising happens off the event loop (ServingContext.offload).
    plan = await ctx.offload(plan_chat, ctx, body, api_key)
    return await serve(
        ctx,
        plan.calls,
        ChatResponse(ctx, body, plan),
        stream=body.stream,
        http_request=http_request,
        prompt_param="messages",
        log_id=plan.id,
    )


class ChatResponse(ResponseBuilder):
    """One chat request's choices, each read by its own output parser, as SSE chunks
    (a role chunk per choice, deltas, one finish chunk per choice, [usage]) or as
    one ``ChatCompletion``.

    With ``prompt_logprobs`` the role chunks wait for the scores, which come with the
    first output (as completions' echo does), and the first one carries them. Should
    another choice's engine call answer before the scoring one (one call per choice
    under a grammar), the scores follow in a chunk of their own once they come."""

    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, plan: ChatPlan) -> None:
        self._ctx = ctx
        self._body = body
        self._plan = plan
        think_end_id = ctx.tokenizer.token_to_id(THINK_END)
        self._parsers = [
            ChatOutputParser(
                starts_in_reasoning=plan.starts_in_reasoning,
                parse_tools=plan.parse_tools,
                forced_calls=plan.forced_calls,
                think_end_id=think_end_id,
                token_texts=ctx.token_texts if plan.logprobs else None,
            )
            for _ in range(body.n)
        ]
        self._exclude = None if body.include_usage else {"usage"}
        self._opened = body.prompt_logprobs is None  # role chunks sent (at once without)
        self._scores_pending = body.prompt_logprobs is not None

    def _chunk(
        self,
        choices: list[ChunkChoice],
        usage: ApiUsage | None = None,
        prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None,
    ) -> bytes:
        plan = self._plan
        payload = ChatCompletionChunk(
            id=plan.id,
            created=plan.created,
            model=plan.model,
            system_fingerprint=self._ctx.settings.system_fingerprint,
            choices=choices,
            usage=usage,
            prompt_logprobs=prompt_logprobs,
        )
        return event(payload, exclude=self._exclude)

    def _reasoning_tokens(self) -> int:
        return sum(p.reasoning_tokens for p in self._parsers)

    def opening(self) -> Iterator[bytes]:
        if self._opened:
            yield from self._role_chunks(None)

    def _role_chunks(
        self, prompt_logprobs: list[dict[str, PromptLogprob] | None] | None
    ) -> Iterator[bytes]:
        for i in range(len(self._parsers)):
            role = ChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
            yield self._chunk([role], prompt_logprobs=prompt_logprobs if i == 0 else None)

    def _prompt_chunks(self, gen: Generation) -> Iterator[bytes]:
        """The deferred role chunks, the first with the prompt's scores if they are in;
        else the scores alone, once they come."""
        scores = _prompt_logprobs(self._ctx, self._body, gen)
        self._scores_pending = scores is None
        if not self._opened:
            self._opened = True
            yield from self._role_chunks(scores)
        elif scores is not None:
            yield self._chunk([], prompt_logprobs=scores)

    def stream(self, gen: Generation, update: ChoiceUpdate) -> Iterator[bytes]:
        if self._scores_pending:
            yield from self._prompt_chunks(gen)
        parser = self._parsers[update.index]
        piece = parser.feed(update.output)
        if not piece.empty:
            logprobs = piece.logprobs() if self._plan.logprobs else None
            delta = piece.delta(self._plan.thinking)
            yield self._chunk([ChunkChoice(index=update.index, delta=delta, logprobs=logprobs)])
        if update.output.finished:
            finish = parser.finish_reason
            yield self._chunk(
                [ChunkChoice(index=update.index, delta=ChatDelta(), finish_reason=finish)]
            )

    def collect(self, update: ChoiceUpdate) -> None:
        self._parsers[update.index].feed(update.output)

    def closing(self, gen: Generation) -> Iterator[bytes]:
        if self._body.include_usage:
            yield self._chunk([], usage=gen.usage(self._reasoning_tokens()))

    def body(self, gen: Generation) -> ChatCompletion:
        plan = self._plan
        return ChatCompletion(
            id=plan.id,
            created=plan.created,
            model=plan.model,
            system_fingerprint=self._ctx.settings.system_fingerprint,
            choices=[
                ChatChoice(
                    index=i,
                    message=p.message(plan.thinking),
                    logprobs=p.logprobs(),
                    finish_reason=p.finish_reason,
                )
                for i, p in enumerate(self._parsers)
            ],
            usage=gen.usage(self._reasoning_tokens()),
            prompt_logprobs=_prompt_logprobs(self._ctx, self._body, gen),
        )


def _prompt_logprobs(
    ctx: ServingContext, body: ChatCompletionRequest, gen: Generation
) -> list[dict[str, PromptLogprob] | None] | None:
    scores = gen.prompt_scores.get(0)
    if body.prompt_logprobs is None or scores is None:
        return None
    return prompt_logprob_entries(ctx.token_texts, scores, body.prompt_logprobs)


def plan_chat(ctx: ServingContext, body: ChatCompletionRequest, api_key: str | None) -> ChatPlan:
    """Prompt, sampling and grammar of every choice; raises ``APIError`` for what cannot run."""
    route = resolve_model(body.model, ctx.settings.served_model_name)
    bias = logit_bias(body, ctx.engine.vocab_size)  # cheap checks before the expensive work
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
    max_tokens = resolve_max_tokens(
        body.max_output_tokens,
        len(ids),
        ctx.engine.max_model_len,
        default=default_max_tokens(thinking, ctx.settings.default_max_tokens),
        prompt_param="messages",
        max_tokens_param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
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
        return EngineCall(Request(f"{request_id}-{k}", ids, params, cache_salt=salt), k)

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
