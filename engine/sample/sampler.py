"""The sampler: logits ``[B, V]`` -> one token per sequence, with its logprob.

Stages, in order (docs/design/engine.md, "Sampling"):

1. ``logit_bias``, then the structured-output mask (disallowed -> -inf), then
   ``min_tokens`` (stop tokens -> -inf while the output is too short);
2. penalties: repetition (prompt + output), frequency, presence (output only);
3. logprobs are read here, from ``log_softmax`` of these processed logits (the
   one distribution both the chosen token's logprob and ``top_logprobs`` come
   from; tokens it gives no probability are never listed), and only when a
   row asks for logprobs: at batch 32 the [32, 129280] pass is ~4% of a CPU step;
4. greedy rows take the argmax; the others go through temperature, top-k,
   top-p, min-p, and an exponential race whose noise comes from the sequence's
   own generator.

Each stage is a function over the batch so it can be tested alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.api.errors import RequestError
from engine.api.sampling_params import SamplingParams
from engine.structured_output.backend import TokenMaskProvider

_NEG_INF = float("-inf")


@dataclass(slots=True)
class SeqHistory:
    """The tokens a sequence has seen: what the penalties count."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B]
    # fp32 [B], of the chosen token after penalties, before truncation; None when no
    # row asks for logprobs (the [B, V] distribution is then never computed).
    logprobs: torch.Tensor | None
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, best first; None if no row asks
    # Rows whose mask provider failed: their token is meaningless, their request must end.
    errors: dict[int, BaseException] = field(default_factory=dict)


def make_generator(
    params: SamplingParams, index: int = 0, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The generator of sequence ``index`` of a request, made once at admission.

    Sequence ``i`` of an ``n > 1`` request is seeded with ``seed + i`` so its
    siblings draw different tokens; ``None`` without a seed (global RNG).
    """
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed((params.seed + index) % 2**64)
    return generator


# ------------------------------------------------------------- logit processing


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each request's ``logit_bias`` to its row, in place."""
    for row, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), device=logits.device)
            logits[row, ids] += bias.to(logits.dtype)


def allowed_token_mask(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A provider's bool ``[V']`` mask or int32 bitmask as a bool ``[vocab_size]`` mask.

    Tokens the mask does not cover (``>= V'``) are disallowed.
    """
    if mask.dtype == torch.bool:
        bits = mask.reshape(-1)
    else:
        assert mask.dtype == torch.int32, f"bitmask must be int32, got {mask.dtype}"
        shifts = torch.arange(32, device=mask.device)
        # int64 keeps bit 31 of a negative word reachable by the shift.
        bits = ((mask.reshape(-1, 1).to(torch.int64) >> shifts) & 1).bool().reshape(-1)
    allowed = torch.zeros(vocab_size, dtype=torch.bool, device=mask.device)
    covered = min(vocab_size, bits.numel())
    allowed[:covered] = bits[:covered]
    return allowed


def apply_token_masks(
    logits: torch.Tensor, masks: Sequence[TokenMaskProvider | None]
) -> dict[int, BaseException]:
    """Set tokens a row's grammar matcher (``masks[row]``) disallows to -inf, in place.

    A provider that raises, or that allows no token at all (a grammar in a dead
    state, e.g. an empty language), fails its own row only: the row is returned
    with its exception and left unmasked so the batch still samples, and the
    engine ends that request with the error (docs/design/engine.md, "Faults").
    """
    failed: dict[int, BaseException] = {}
    for row, provider in enumerate(masks):
        if provider is None:
            continue
        try:
            mask = provider.allowed_tokens()
            if mask is None:
                continue
            allowed = allowed_token_mask(mask, logits.shape[1]).to(logits.device)
            if not bool(allowed.any()):
                raise RequestError(
                    None,
                    "the required output format allows no next token here: its grammar "
                    "describes no complete output (for example a pattern no string matches)",
                )
        except Exception as exc:  # the row's own fault; the engine keeps running
            failed[row] = exc
            continue
        logits[row].masked_fill_(~allowed, _NEG_INF)
    return failed


def apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[SeqHistory],
    eos_token_id: int | None,
) -> None:
    """Forbid EOS and ``stop_token_ids`` while the output is shorter than ``min_tokens``.

    The structured-output mask wins: if forbidding them would leave no token
    (the grammar can only end here), the row is left as it is.
    """
    for row, (p, h) in enumerate(zip(params, histories, strict=True)):
        if len(h.output_token_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if eos_token_id is not None and not p.ignore_eos:
            stops.add(eos_token_id)
        if not stops:
            continue
        ids = torch.tensor(sorted(stops), device=logits.device)
        finite = torch.isfinite(logits[row])
        finite[ids] = False
        if bool(finite.any()):
            logits[row, ids] = _NEG_INF


def _token_counts(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """``counts[r, t]`` = occurrences of token ``t`` in ``rows[r]`` (fp32)."""
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    row_idx = [r for r, ids in enumerate(rows) for _ in ids]
    if row_idx:
        tok = torch.tensor([t for ids in rows for t in ids], device=device)
        r = torch.tensor(row_idx, device=device)
        counts.index_put_((r, tok), torch.ones_like(tok, dtype=torch.float32), accumulate=True)
    return counts


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[SeqHistory]
) -> None:
    """Repetition, then frequency, then presence penalty, in place.

    Repetition (HF/vLLM): every token seen in prompt or output has a positive
    logit divided by the penalty, a negative one multiplied. Frequency and
    presence (OpenAI): subtract ``f * count`` and ``p * (count > 0)`` over the
    output tokens only.
    """
    rows = [
        r
        for r, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    ]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    idx = torch.tensor(rows, device=device)
    sub = logits[idx]
    outputs = [histories[r].output_token_ids for r in rows]
    out_counts = _token_counts(outputs, vocab, device)
    seen = _token_counts([histories[r].prompt_token_ids for r in rows], vocab, device) > 0
    seen |= out_counts > 0

    def column(name: str) -> torch.Tensor:
        values = [getattr(params[r], name) for r in rows]
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    rep = column("repetition_penalty")
    penalised = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalised, sub)
    sub = sub - column("frequency_penalty") * out_counts
    sub = sub - column("presence_penalty") * (out_counts > 0).to(sub.dtype)
    logits[idx] = sub


# ------------------------------------------------------------------ truncation


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> None:
    """Keep each row's ``k`` largest logits (ties with the k-th kept); ``k <= 0`` = off."""
    vocab = logits.shape[1]
    active = (top_k > 0) & (top_k < vocab)
    if not bool(active.any()):
        return
    idx = active.nonzero().squeeze(1)
    k = top_k[idx].to(torch.int64)
    sub = logits[idx]
    best = sub.topk(int(k.max()), dim=1).values
    kth = best.gather(1, (k - 1).unsqueeze(1))
    logits[idx] = sub.masked_fill(sub < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """Keep the smallest best-first set of tokens whose mass reaches ``p``.

    A token is kept iff the mass of the tokens ranked above it is below ``p``,
    so the token that crosses ``p`` stays (HF/vLLM). Equal probabilities rank
    by token id.
    """
    active = top_p < 1.0
    if not bool(active.any()):
        return
    idx = active.nonzero().squeeze(1)
    sub = logits[idx]
    probs, order = sub.softmax(dim=1).sort(dim=1, descending=True, stable=True)
    # Exclusive cumulative sum (not cumsum - probs, whose rounding can reach p early).
    mass_before = torch.zeros_like(probs)
    mass_before[:, 1:] = probs[:, :-1].cumsum(dim=1)
    drop_sorted = mass_before >= top_p[idx].unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    logits[idx] = sub.masked_fill(drop, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below ``min_p`` times the row's best."""
    active = min_p > 0.0
    if not bool(active.any()):
        return
    idx = active.nonzero().squeeze(1)
    sub = logits[idx]
    probs = sub.softmax(dim=1)
    threshold = min_p[idx].unsqueeze(1) * probs.max(dim=1, keepdim=True).values
    logits[idx] = sub.masked_fill(probs < threshold, _NEG_INF)


def truncate(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p over non-greedy rows; returns new logits."""
    device = logits.device

    def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    out = logits / column([p.temperature for p in params], logits.dtype).unsqueeze(1)
    apply_top_k(out, column([p.top_k for p in params], torch.int64))
    apply_top_p(out, column([p.top_p for p in params], logits.dtype))
    apply_min_p(out, column([p.min_p for p in params], logits.dtype))
    return out


def exponential_race(
    probs: torch.Tensor, generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One draw per row: ``argmax(probs / E)`` with ``E ~ Exponential(1)`` per token.

    The smallest ``E_t / p_t`` wins with probability ``p_t / sum p``. A row with
    a generator takes exactly ``V`` draws from it, so its tokens do not depend
    on which other rows share the batch; rows without one share the global RNG.
    """
    noise = torch.empty_like(probs)
    unseeded = [r for r, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        noise.exponential_()
    elif unseeded:
        idx = torch.tensor(unseeded, device=probs.device)
        noise[idx] = torch.empty_like(noise[idx]).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # A zero draw would turn a masked token's 0 / 0 into NaN, which argmax picks.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=1)


# --------------------------------------------------------------------- sampler


class Sampler:
    """Turns a batch of logits into tokens; see the module docstring for the order."""

    def __init__(self, eos_token_id: int | None = None) -> None:
        # Needed only for `min_tokens`, which must forbid EOS.
        self.eos_token_id = eos_token_id

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[SeqHistory],
        generators: Sequence[torch.Generator | None],
        masks: Sequence[TokenMaskProvider | None] | None = None,
    ) -> SamplerOutput:
        """One token per row; ``masks``: each row's grammar matcher (None: free text)."""
        batch = logits.shape[0]
        assert logits.dim() == 2, f"logits must be [B, V], got {tuple(logits.shape)}"
        masks = [None] * batch if masks is None else masks
        assert len(params) == len(histories) == len(generators) == len(masks) == batch
        # The caller's tensor stays untouched: copied only when a stage below writes
        # in place (a [32, 129280] copy is ~5 ms of a CPU step).
        edits = any(_edits_in_place(p) for p in params) or any(m is not None for m in masks)
        logits = logits.to(torch.float32, copy=edits)
        apply_logit_bias(logits, params)
        errors = apply_token_masks(logits, masks)
        apply_min_tokens(logits, params, histories, self.eos_token_id)
        apply_penalties(logits, params, histories)
        # The distribution only when a row reports logprobs (its token's value and its
        # top_logprobs then come from the same tensor).
        wants = any(p.logprobs is not None for p in params)
        logprobs = logits.log_softmax(dim=1) if wants else None

        token_ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
        greedy = [r for r, p in enumerate(params) if p.greedy]
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        if greedy:
            # max(dim).indices is argmax (ties: the lowest id; NaN wins alike) at a
            # fraction of its CPU time; an all-greedy batch skips the row gather.
            if len(greedy) == batch:
                token_ids = logits.max(dim=1).indices
            else:
                idx = torch.tensor(greedy, device=logits.device)
                token_ids[idx] = logits[idx].max(dim=1).indices
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            kept = truncate(logits[idx], [params[r] for r in sampled])
            token_ids[idx] = exponential_race(kept.softmax(dim=1), [generators[r] for r in sampled])

        if logprobs is None:
            return SamplerOutput(token_ids, None, None, errors)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return SamplerOutput(token_ids, chosen, _top_logprobs(logprobs, params), errors)


def _edits_in_place(p: SamplingParams) -> bool:
    """Whether a stage of ``sample`` writes into the logits row of ``p``."""
    return bool(
        p.logit_bias
        or p.min_tokens > 0
        or p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


def _top_logprobs(
    logprobs: torch.Tensor, params: Sequence[SamplingParams]
) -> list[list[tuple[int, float]]] | None:
    """The ``logprobs`` best (token, logprob) pairs of each row that asks for them.

    Tokens the row cannot produce (masked by a grammar, banned, -inf) are left
    out, so a row allowing fewer than ``logprobs`` tokens lists fewer: every
    entry is a real probability of the distribution the token was drawn from.
    """
    if all(p.logprobs is None for p in params):
        return None
    ks = [p.logprobs or 0 for p in params]
    widest = max(ks)
    if widest == 0:
        return [[] for _ in params]
    values, ids = logprobs.topk(widest, dim=1)
    values_list, ids_list = values.tolist(), ids.tolist()
    return [
        [(t, v) for t, v in zip(ids_list[r][:k], values_list[r][:k], strict=True) if v > _NEG_INF]
        for r, k in enumerate(ks)
    ]
