"""``POST /v1/completions`` (and ``/completions``) and FIM at ``/beta/completions``.

Each prompt is one engine request with ``n`` choices; choice ``k`` of prompt
``i`` has index ``i * n + k`` (OpenAI's order). A ``suffix`` (or the ``/beta``
path) makes the prompt fill-in-the-middle: the model writes what goes between
``prompt`` and ``suffix``. ``echo`` puts the prompt text before the output;
with ``logprobs`` its tokens are scored (the engine runs such a prompt at full
depth), as is every prompt token with vLLM's ``prompt_logprobs``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from engine.api.request import CompletionOutput, Request, TokenLogprob
from server.chat.chat_encoding import encode_completion, encode_fim
from server.http.auth import tenant_salt
from server.http.errors import invalid_request
from server.http.sse import event
from server.openai.generation import ChoiceUpdate, EngineCall, Generation, ServingContext
from server.openai.logprobs import (
    MIN_LOGPROB,
    clamp_logprob,
    extend_completion_logprobs,
    extend_prompt_logprobs,
    prompt_logprob_entries,
)
from server.openai.model_names import default_max_tokens, resolve_model
from server.openai.protocol import (
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    FinishReason,
    PromptLogprob,
    resolve_max_tokens,
)
from server.openai.protocol import Usage as ApiUsage
from server.openai.sampling import check_fan_out, logit_bias, sampling_params
from server.openai.serving_base import ResponseBuilder, serve


@dataclass(slots=True)
class _Prompt:
    ids: list[int]  # what the engine reads
    echo_text: str  # what ``echo`` shows: the prompt as the client wrote it
    echo_ids: list[int]  # the tokens of ``echo_text``, for ``logprobs``


@dataclass(slots=True)
class _Choice:
    """One choice's text and logprobs; ``offset`` is where the next token's text starts."""

    text: str = ""
    logprobs: CompletionLogprobs | None = None
    offset: int = 0
    finish_reason: FinishReason | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


async def create_completion(
    ctx: ServingContext,
    body: CompletionRequest,
    *,
    api_key: str | None,
    http_request: HttpRequest,
    fim: bool,
) -> Response:
    """``fim``: the ``/beta/completions`` path (always fill-in-the-middle)."""
    route = resolve_model(body.model, ctx.settings.served_model_name)
    check_fan_out(ctx, body.n, len(body.prompts()))
    bias = logit_bias(body, ctx.engine.vocab_size)  # cheap checks before tokenising
    # Tokenising happens off the event loop (ServingContext.offload).
    prompts = await ctx.offload(_prompts, ctx, body, fim)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    salt = tenant_salt(api_key, body.cache_salt)
    calls = []
    for i, prompt in enumerate(prompts):
        max_tokens = resolve_max_tokens(
            body.max_tokens,
            len(prompt.ids),
            ctx.engine.max_model_len,
            default=default_max_tokens(False, ctx.settings.default_max_tokens),
            prompt_param="prompt",
        )
        params = sampling_params(
            body,
            max_tokens=max_tokens,
            n=body.n,
            logprobs=body.logprobs,
            vocab_size=ctx.engine.vocab_size,
            bias=bias,
            prompt_logprobs=_prompt_scoring(body),
        )
        request = Request(f"{request_id}-{i}", prompt.ids, params, cache_salt=salt)
        calls.append(EngineCall(request, first_index=i * body.n, prompt_group=i))
    builder = CompletionResponse(ctx, body, prompts, request_id, route.name)
    return await serve(
        ctx,
        calls,
        builder,
        stream=body.stream,
        http_request=http_request,
        prompt_param="prompt",
        log_id=request_id,
    )


class CompletionResponse(ResponseBuilder):
    """The choices of a completions request as SSE chunks (an echo per choice, text
    deltas, a finish chunk per choice, [usage]) or as one ``Completion``."""

    def __init__(
        self,
        ctx: ServingContext,
        body: CompletionRequest,
        prompts: list[_Prompt],
        request_id: str,
        model: str,
    ) -> None:
        self._ctx = ctx
        self._body = body
        self._prompts = prompts
        self._id = request_id
        self._model = model
        self._created = int(time.time())
        self._choices = [
            _start_choice(ctx, prompts[i // body.n], body) for i in range(len(prompts) * body.n)
        ]
        self._exclude = None if body.include_usage else {"usage"}
        # The prompt is the first text of each choice; when it is scored, it waits for
        # the scores (they come with the first tokens, after the prefill).
        self._echo_now = body.echo and _prompt_scoring(body) is None
        self._echo_pending = not self._echo_now and (body.echo or body.prompt_logprobs is not None)
        self._echoed: set[int] = set()

    def _chunk(self, items: list[CompletionChoice], usage: ApiUsage | None = None) -> bytes:
        payload = CompletionChunk(
            id=self._id,
            created=self._created,
            model=self._model,
            system_fingerprint=self._ctx.settings.system_fingerprint,
            choices=items,
            usage=usage,
        )
        return event(payload, exclude=self._exclude)

    def opening(self) -> Iterator[bytes]:
        if self._echo_now:
            for i, c in enumerate(self._choices):
                yield self._chunk([CompletionChoice(index=i, text=c.text, logprobs=c.logprobs)])

    def stream(self, gen: Generation, update: ChoiceUpdate) -> Iterator[bytes]:
        n = self._body.n
        k = update.index // n
        if self._echo_pending and k not in self._echoed:  # its prompt's scores came with it
            self._echoed.add(k)
            for i in range(k * n, (k + 1) * n):
                c = self._choices[i]
                self._score(c, k, gen)
                echo = CompletionChoice(
                    index=i, text=c.text, logprobs=c.logprobs, prompt_logprobs=c.prompt_logprobs
                )
                yield self._chunk([echo])
        choice = self._choices[update.index]
        out = update.output
        logprobs = _apply(self._ctx, choice, out)
        if out.text or (logprobs is not None and logprobs.tokens):
            yield self._chunk(
                [CompletionChoice(index=update.index, text=out.text, logprobs=logprobs)]
            )
        if out.finish_reason is not None:
            done = CompletionChoice(index=update.index, text="", finish_reason=choice.finish_reason)
            yield self._chunk([done])

    def collect(self, update: ChoiceUpdate) -> None:
        _apply(self._ctx, self._choices[update.index], update.output)

    def closing(self, gen: Generation) -> Iterator[bytes]:
        if self._body.include_usage:
            yield self._chunk([], usage=gen.usage())

    def body(self, gen: Generation) -> Completion:
        for i, c in enumerate(self._choices):
            self._score(c, i // self._body.n, gen)
        return Completion(
            id=self._id,
            created=self._created,
            model=self._model,
            system_fingerprint=self._ctx.settings.system_fingerprint,
            choices=[
                CompletionChoice(
                    index=i,
                    text=c.text,
                    logprobs=c.logprobs,
                    finish_reason=c.finish_reason or "stop",
                    prompt_logprobs=c.prompt_logprobs,
                )
                for i, c in enumerate(self._choices)
            ],
            usage=gen.usage(),
        )

    def _score(self, choice: _Choice, prompt: int, gen: Generation) -> None:
        scores = gen.prompt_scores.get(prompt)
        _score_prompt(self._ctx, self._body, choice, self._prompts[prompt], scores)


def completion_prompt_ids(
    ctx: ServingContext, body: CompletionRequest, fim: bool
) -> list[list[int]]:
    """The token ids of each prompt, as ``create_completion`` feeds them to the engine."""
    resolve_model(body.model, ctx.settings.served_model_name)
    return [p.ids for p in _prompts(ctx, body, fim)]


def _prompts(ctx: ServingContext, body: CompletionRequest, fim: bool) -> list[_Prompt]:
    return [_prompt(ctx, p, body.suffix, fim) for p in body.prompts()]


def _prompt(ctx: ServingContext, prompt: str | list[int], suffix: str | None, fim: bool) -> _Prompt:
    if isinstance(prompt, list):
        if suffix is not None or fim:
            raise invalid_request("fill-in-the-middle needs a text prompt", "prompt")
        bad = [t for t in prompt if not 0 <= t < ctx.engine.vocab_size]
        if bad:
            raise invalid_request(
                f"prompt: token id {bad[0]} is outside the vocabulary "
                f"(size {ctx.engine.vocab_size})",
                "prompt",
            )
        return _Prompt(list(prompt), ctx.decode(prompt), prompt)
    text = encode_fim(prompt, suffix) if fim or suffix is not None else encode_completion(prompt)
    return _Prompt(ctx.encode(text, "prompt"), prompt, ctx.encode(prompt, "prompt"))


def _start_choice(ctx: ServingContext, prompt: _Prompt, body: CompletionRequest) -> _Choice:
    """A choice before generation: the echoed prompt (and its logprob rows) already in."""
    choice = _Choice(logprobs=CompletionLogprobs() if body.logprobs is not None else None)
    if body.echo:
        choice.text = prompt.echo_text
        if choice.logprobs is not None:
            extend_prompt_logprobs(choice.logprobs, ctx.token_texts, prompt.echo_ids, 0)
        choice.offset = len(prompt.echo_text)
    return choice


def _prompt_scoring(body: CompletionRequest) -> int | None:
    """How many alternatives each prompt token's score lists; None: the prompt is not
    scored. ``echo`` with ``logprobs`` scores it as the legacy API does."""
    if body.prompt_logprobs is not None:
        return max(body.prompt_logprobs, body.logprobs or 0) if body.echo else body.prompt_logprobs
    return body.logprobs if body.echo and body.logprobs is not None else None


def _score_prompt(
    ctx: ServingContext,
    body: CompletionRequest,
    choice: _Choice,
    prompt: _Prompt,
    scores: list[TokenLogprob] | None,
) -> None:
    """Fill the echoed prompt's logprob rows and ``prompt_logprobs`` from the engine's
    scores (entry i scores engine token i + 1)."""
    if scores is None:
        return
    ids = prompt.ids
    if body.prompt_logprobs is not None:
        k = body.prompt_logprobs
        choice.prompt_logprobs = prompt_logprob_entries(ctx.token_texts, scores, k)
    lp = choice.logprobs
    if not body.echo or lp is None:
        return
    # The echoed tokens are the engine prompt's tail (text prompts add BOS before them).
    first = len(ids) - len(prompt.echo_ids)
    if first < 0 or list(ids[first:]) != list(prompt.echo_ids):
        return  # a FIM prompt: its echo is not a tail of the engine prompt
    k = body.logprobs or 0
    for j in range(len(prompt.echo_ids)):
        position = first + j
        if position == 0:
            continue  # the very first token has no context: no logprob, as OpenAI's
        s = scores[position - 1]
        lp.token_logprobs[j] = clamp_logprob(s.logprob)
        top: dict[str, float] = {}
        for token_id, value in s.top_logprobs[:k]:
            key = ctx.token_texts.text(token_id)
            top[key] = max(top.get(key, MIN_LOGPROB), clamp_logprob(value))
        lp.top_logprobs[j] = top


def _apply(
    ctx: ServingContext, choice: _Choice, out: CompletionOutput
) -> CompletionLogprobs | None:
    """Add one engine delta; returns the delta's own logprobs (for a stream chunk)."""
    choice.text += out.text
    delta_logprobs = None
    if choice.logprobs is not None and out.logprobs is not None:
        delta_logprobs = CompletionLogprobs()
        start = choice.offset
        choice.offset = extend_completion_logprobs(
            delta_logprobs, ctx.token_texts, out.logprobs, start
        )
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(choice.logprobs, name).extend(getattr(delta_logprobs, name))
    if out.finish_reason is not None:
        choice.finish_reason = "length" if out.finish_reason == "length" else "stop"
    return delta_logprobs
