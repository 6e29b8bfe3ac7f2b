"""``POST /v1/chat/completions`` (and ``/chat/completions``, ``/beta/chat/completions``).

messages -> V4.1 prompt -> engine requests (``plan_chat``, server/chat/chat_plan.py,
which the Messages API shares) -> ``reasoning_content`` / ``content`` /
``tool_calls`` per choice, as one JSON body or as SSE chunks. Chat prefix
completion (a last assistant message with ``prefix: true``) is served at every
path; DeepSeek documents it under ``/beta``.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from engine.api.special_tokens import THINK_END
from server.chat.chat_output import ChatOutputParser
from server.chat.chat_plan import ChatPlan, fetch_chat_images, plan_chat
from server.http.sse import event
from server.openai.generation import ChoiceUpdate, Generation, ServingContext
from server.openai.logprobs import prompt_logprob_entries
from server.openai.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChunkChoice,
    PromptLogprob,
)
from server.openai.protocol import Usage as ApiUsage
from server.openai.sampling import check_fan_out
from server.openai.serving_base import ResponseBuilder, serve


async def create_chat_completion(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    *,
    api_key: str | None,
    http_request: HttpRequest,
) -> Response:
    check_fan_out(ctx, body.n, 1)
    fetched = await fetch_chat_images(ctx, body)
    # Tokenising and decoding images happen off the event loop (ServingContext.offload).
    plan = await ctx.offload(plan_chat, ctx, body, api_key, fetched)
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
