"""API sampling parameters -> the engine's ``SamplingParams``.

Defaults are DeepSeek's and OpenAI's: temperature 1, top_p 1, no penalties.
pydantic has checked every range already; what needs the model (token ids
within the vocabulary) is checked here, once per request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from engine.api.sampling_params import SamplingParams, StructuredOutputSpec
from server.http.errors import invalid_parameter, invalid_request
from server.openai.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from server.openai.generation import ServingContext

# OpenAI's "ban" value: -100 makes a token practically impossible.
BANNED_BIAS = -100.0


def logit_bias(
    body: ChatCompletionRequest | CompletionRequest, vocab_size: int
) -> dict[int, float]:
    """The request's ``logit_bias`` by token id, checked against the vocabulary (the one
    check of its ids; pydantic has checked keys and values). Called once, before the
    expensive work; ``sampling_params`` takes its result."""
    bias = body.logit_bias_ids()
    for token_id in bias:
        if token_id >= vocab_size:
            raise invalid_parameter(
                f"logit_bias: token id {token_id} is outside the vocabulary (size {vocab_size})",
                "logit_bias",
            )
    return bias


def _with_banned(bias: dict[int, float], banned: Iterable[int]) -> dict[int, float] | None:
    out = dict(bias)
    for token_id in banned:
        out[token_id] = min(out.get(token_id, 0.0), BANNED_BIAS)
    return out or None


def check_fan_out(ctx: ServingContext, n: int, prompts: int) -> None:
    """Refuse a request whose engine sequences (prompts x n) exceed the per-request limit,
    or that the admission limits would turn away now (429), before any tokenising."""
    limit = ctx.settings.max_sequences_per_request
    if prompts * n > limit:
        param = "n" if prompts == 1 else "prompt"
        raise invalid_request(
            f"{param}: {prompts} prompt(s) x n={n} make {prompts * n} sequences; at most "
            f"{limit} per request",
            param,
        )
    ctx.admission.check(prompts * n)


def sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int,
    n: int,
    logprobs: int | None,
    vocab_size: int,
    bias: dict[int, float],
    banned: Iterable[int] = (),
    seed_offset: int = 0,
    structured: StructuredOutputSpec | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """``n`` choices of ``body``; ``seed_offset`` seeds choice ``k`` of a split request as
    ``seed + k``, which is how the engine seeds sibling choices of one request.
    ``bias``: what ``logit_bias`` returned for ``body``; ``banned`` ids are added to it."""
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        # k at or past the vocabulary keeps every token: the same as off (and no overflow).
        top_k=-1 if body.top_k is None or body.top_k >= vocab_size else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        seed=None if body.seed is None else body.seed + seed_offset,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_with_banned(bias, banned),
        max_tokens=max_tokens,
        stop=body.stop_list,
        n=n,
        structured=structured,
    )
