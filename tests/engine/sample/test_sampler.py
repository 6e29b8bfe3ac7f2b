"""Sampler stages against hand-computed values, transformers' warpers, and statistics."""

from __future__ import annotations

import math

import pytest
import torch

from engine.api.errors import RequestError
from engine.api.sampling_params import SamplingParams
from engine.sample.sampler import (
    Sampler,
    SeqHistory,
    allowed_token_mask,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_token_masks,
    apply_top_k,
    apply_top_p,
    make_generator,
    truncate,
)

INF = float("inf")


def _empty(n: int = 1) -> list[SeqHistory]:
    return [SeqHistory([], []) for _ in range(n)]


class FixedMask:
    """A TokenMaskProvider that always allows the same tokens."""

    def __init__(self, mask: torch.Tensor | None) -> None:
        self.mask = mask
        self.accepted: list[int] = []

    def allowed_tokens(self) -> torch.Tensor | None:
        return self.mask

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def is_terminated(self) -> bool:
        return False


def _bool_mask(vocab: int, allowed: list[int]) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[allowed] = True
    return mask


# ------------------------------------------------------------------ params


def test_validate_names_the_field() -> None:
    SamplingParams(temperature=0.0, top_k=5, stop=["x"], logprobs=20).validate(vocab_size=10)
    for bad, field in [
        (SamplingParams(temperature=-1.0), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(logprobs=21), "logprobs"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(stop=[""]), "stop"),
        (SamplingParams(n=0), "n"),
        (SamplingParams(logit_bias={3: math.nan}), "logit_bias"),
    ]:
        with pytest.raises(RequestError, match=field) as caught:
            bad.validate()
        assert caught.value.param == field
    with pytest.raises(RequestError, match="stop_token_ids") as caught:
        SamplingParams(stop_token_ids=[10]).validate(vocab_size=10)
    assert caught.value.param == "stop_token_ids"


def test_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_make_generator_seeds_sequence_i_with_seed_plus_i() -> None:
    assert make_generator(SamplingParams()) is None
    a = make_generator(SamplingParams(seed=7), index=1)
    b = make_generator(SamplingParams(seed=8), index=0)
    assert a is not None and b is not None
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


# ------------------------------------------------------------- truncation


def test_top_k_hand_computed_keeps_ties() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 5.0, 0.0], [1.0, 3.0, 3.0, 5.0, 0.0], [1, 2, 3, 4, 5.0]])
    apply_top_k(logits, torch.tensor([2, 2, -1]))
    assert logits.tolist() == [
        [-INF, 3.0, -INF, 5.0, -INF],
        [-INF, 3.0, 3.0, 5.0, -INF],  # both tokens tied at the k-th value stay
        [1.0, 2.0, 3.0, 4.0, 5.0],  # -1: off
    ]


def _log(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def test_top_p_keeps_the_token_that_crosses_p() -> None:
    # Probabilities 0.3, 0.05, 0.5, 0.15 (best-first: ids 2, 0, 3, 1).
    row = _log([0.3, 0.05, 0.5, 0.15])
    cases = {
        0.45: [2],  # 0.5 alone already crosses 0.45
        0.55: [2, 0],  # 0.5 < 0.55, so id 0 (0.3) is needed and kept
        0.81: [2, 0, 3],  # 0.8 < 0.81: id 3 crosses and stays
        0.96: [2, 0, 3, 1],
        1.0: [0, 1, 2, 3],
    }
    logits = row.repeat(len(cases), 1)
    apply_top_p(logits, torch.tensor(list(cases)))
    for r, kept in enumerate(cases.values()):
        assert torch.isfinite(logits[r]).nonzero().flatten().tolist() == sorted(kept)
        assert torch.equal(logits[r, kept], row[kept])  # kept logits untouched


def test_top_p_equal_probabilities_rank_by_id() -> None:
    logits = torch.zeros(3, 4)  # four tokens of exactly 0.25
    apply_top_p(logits, torch.tensor([0.3, 0.5, 0.75]))
    assert torch.isfinite(logits).tolist() == [
        [True, True, False, False],  # 0.25 < 0.3: the second token crosses and stays
        [True, True, False, False],  # exactly 0.5 reached by two: the third is not needed
        [True, True, True, False],
    ]


def test_min_p_hand_computed() -> None:
    row = _log([0.5, 0.3, 0.15, 0.05])
    logits = row.repeat(3, 1)
    apply_min_p(logits, torch.tensor([0.2, 0.35, 0.0]))  # thresholds 0.1, 0.175, off
    finite = torch.isfinite(logits).tolist()
    assert finite == [[True, True, True, False], [True, True, False, False], [True] * 4]


def test_truncate_applies_temperature_first() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    out = truncate(logits, [SamplingParams(temperature=2.0), SamplingParams(temperature=0.5)])
    assert torch.allclose(out, torch.tensor([[0.5, 1.0, 1.5], [2.0, 4.0, 6.0]]))
    # Top-p sees the tempered distribution: at T = 0.25 token 2 holds ~98% alone.
    sharp = truncate(logits[:1], [SamplingParams(temperature=0.25, top_p=0.9)])
    assert torch.isfinite(sharp[0]).tolist() == [False, False, True]
    flat = truncate(logits[:1], [SamplingParams(temperature=4.0, top_p=0.9)])
    assert torch.isfinite(flat[0]).all()


def test_truncate_matches_transformers_warpers() -> None:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.6, min_p=0.1),
        SamplingParams(temperature=2.0, top_p=0.95),
        SamplingParams(temperature=1.0),
    ]
    ours = truncate(logits, params)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for r, p in enumerate(params):
        ref = TemperatureLogitsWarper(p.temperature)(ids, logits[r : r + 1].clone())
        if p.top_k > 0:
            ref = TopKLogitsWarper(p.top_k)(ids, ref)
        if p.top_p < 1:
            ref = TopPLogitsWarper(p.top_p)(ids, ref)
        if p.min_p > 0:
            ref = MinPLogitsWarper(p.min_p)(ids, ref)
        assert torch.equal(torch.isfinite(ours[r]), torch.isfinite(ref[0])), r
        kept = torch.isfinite(ref[0])
        assert torch.allclose(ours[r, kept], ref[0, kept]), r


# ------------------------------------------------------ logits processing


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 2)
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),  # no penalty: row untouched
    ]
    histories = [SeqHistory([0, 1], [3, 3, 2]), SeqHistory([0, 1], [3, 3, 2])]
    apply_penalties(logits, params, histories)
    # id 0: prompt, 2/2; id 1: prompt, -1*2; id 2: output once, 0.5/2 - 0.5 - 0.25;
    # id 3: output twice, 3/2 - 2*0.5 - 0.25; id 4: unseen.
    assert torch.allclose(logits[0], torch.tensor([1.0, -2.0, -0.5, 0.25, -2.0]))
    assert logits[1].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 4)
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    apply_penalties(logits, [p], [SeqHistory([0, 0, 1], [1, 2, 2, 2])])
    assert logits[0].tolist() == [0.0, -2.0, -4.0, 0.0]


def test_repetition_penalty_matches_transformers() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 30, generator=gen)
    history = SeqHistory([3, 7, 7, 12], [20, 3, 29])
    ours = logits.clone()
    apply_penalties(ours, [SamplingParams(repetition_penalty=1.3)], [history])
    ids = torch.tensor([[3, 7, 7, 12, 20, 3, 29]])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    assert torch.allclose(ours, ref)


def test_logit_bias_hand_computed() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]])
    apply_logit_bias(logits, [SamplingParams(logit_bias={1: 5.0, 3: -100.0}), SamplingParams()])
    assert logits.tolist() == [[0.0, 6.0, 2.0, -97.0], [0.0, 1.0, 2.0, 3.0]]


def test_bitmask_and_short_bool_mask() -> None:
    allowed = [0, 5, 31, 33, 39]
    words = [0, 0]
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    # Word 0 has bit 31 set: as int32 it is negative.
    bitmask = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
    assert int(bitmask[0]) < 0
    got = allowed_token_mask(bitmask, 40)
    assert got.nonzero().flatten().tolist() == allowed
    # Tokens past the mask's length are disallowed.
    short = allowed_token_mask(_bool_mask(10, [2, 9]), 40)
    assert short.nonzero().flatten().tolist() == [2, 9]


def test_mask_is_applied_after_logit_bias() -> None:
    vocab = 8
    provider = FixedMask(_bool_mask(vocab, [1, 4]))
    logits = torch.zeros(2, vocab)
    params = [SamplingParams(logit_bias={0: 100.0}), SamplingParams()]
    apply_logit_bias(logits, params)
    apply_token_masks(logits, [provider, None])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 4]
    assert torch.isfinite(logits[1]).all()
    apply_token_masks(logits, [FixedMask(None)] * 2)  # no-op


def test_sampler_never_picks_a_masked_token_and_does_not_accept() -> None:
    vocab = 16
    provider = FixedMask(_bool_mask(vocab, [3, 11]))
    params = SamplingParams(logit_bias={5: 50.0}, logprobs=0)
    logits = torch.randn(200, vocab, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    out = Sampler().sample(logits, [params] * 200, _empty(200), [None] * 200, [provider] * 200)
    assert set(out.token_ids.tolist()) == {3, 11}
    # Logprobs are over the allowed tokens only.
    expected = logits[:, [3, 11]].double().log_softmax(dim=1)
    col = (out.token_ids == 11).long()
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs.double(), expected.gather(1, col[:, None]).squeeze(1))
    assert provider.accepted == []  # accepting is the engine's job


# ----------------------------------------------------------------- sampler


def test_greedy_ties_take_the_lowest_id() -> None:
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [7.0, 7.0, 7.0, 7.0]])
    out = Sampler().sample(logits, [SamplingParams(temperature=0.0)] * 2, _empty(2), [None] * 2)
    assert out.token_ids.tolist() == [1, 0]


def test_logprobs_after_penalties_before_temperature() -> None:
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]] * 2)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=2),
        SamplingParams(temperature=0.5, top_k=1, repetition_penalty=2.0, logprobs=0),
    ]
    histories = [SeqHistory([0], []), SeqHistory([0], [])]
    out = Sampler().sample(logits, params, histories, [None, None])
    lp = torch.tensor([1.5, 1.0, 0.0, -1.0], dtype=torch.float64).log_softmax(dim=0)  # id 0 halved
    assert out.token_ids.tolist() == [0, 0]
    # Row 1 sampled at T = 0.5 from top-1, yet reports the untempered, untruncated logprob.
    assert torch.allclose(out.logprobs.double(), lp[[0, 0]])
    assert out.top_logprobs is not None
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1]
    assert torch.allclose(torch.tensor([v for _, v in out.top_logprobs[0]]).double(), lp[:2])
    assert out.top_logprobs[1] == []


def test_top_logprobs_under_a_mask_list_only_allowed_tokens() -> None:
    """A grammar allowing 2 tokens gives 2 entries for top_logprobs=5, with their
    hand-computed logprobs over the allowed set; masked tokens never appear."""
    logits = torch.tensor([[0.0, 2.0, 9.0, 1.0, 5.0, 0.5]])
    provider = FixedMask(_bool_mask(6, [1, 3]))
    params = [SamplingParams(temperature=0.0, logprobs=5)]
    out = Sampler().sample(logits, params, _empty(), [None], [provider])
    assert out.top_logprobs is not None
    (top,) = out.top_logprobs
    z = math.log(math.exp(2.0) + math.exp(1.0))
    assert [t for t, _ in top] == [1, 3]
    assert [v for _, v in top] == pytest.approx([2.0 - z, 1.0 - z], abs=1e-6)
    assert out.token_ids.tolist() == [1]
    assert out.logprobs.tolist() == pytest.approx([2.0 - z], abs=1e-6)


def test_top_logprobs_none_when_nobody_asks() -> None:
    out = Sampler().sample(torch.zeros(2, 4), [SamplingParams()] * 2, _empty(2), [None] * 2)
    assert out.top_logprobs is None and out.logprobs is None
    # One row asking gives every row its chosen token's logprob.
    params = [SamplingParams(), SamplingParams(logprobs=0)]
    out = Sampler().sample(torch.zeros(2, 4), params, _empty(2), [None] * 2)
    assert out.logprobs is not None
    assert torch.allclose(out.logprobs, torch.full((2,), math.log(0.25)))


def test_sampler_leaves_callers_logits_alone() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    params = [SamplingParams(logit_bias={0: 3.0}, repetition_penalty=2.0)]
    Sampler().sample(logits, params, [SeqHistory([2], [])], [None])
    assert logits.tolist() == [[1.0, 2.0, 3.0]]


def test_min_tokens_forbids_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 10.0, 0.0, 9.0, 1.0]] * 4)
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    params = [p, p, SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True), p]
    histories = [
        SeqHistory([], [4]),
        SeqHistory([], [4, 4]),
        SeqHistory([], []),
        SeqHistory([], []),
    ]
    # Row 3's grammar allows only EOS: the grammar wins over min_tokens.
    params[3] = SamplingParams(temperature=0.0, min_tokens=2)
    masks = [None, None, None, FixedMask(_bool_mask(5, [1]))]
    out = Sampler(eos_token_id=1).sample(logits, params, histories, [None] * 4, masks)
    assert out.token_ids.tolist() == [4, 1, 1, 1]


# ------------------------------------------------------------- randomness


def _stream(params: SamplingParams, index: int, steps: int, vocab: int) -> list[torch.Tensor]:
    """Logits a sequence sees at each step: a function of the sequence alone."""
    gen = torch.Generator().manual_seed(1000 + index)
    return [torch.randn(vocab, generator=gen) * 2 for _ in range(steps)]


def test_seeded_tokens_do_not_depend_on_the_batch() -> None:
    vocab, steps = 64, 20
    seeds = [11, 22, 33, None, 44]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in seeds]
    params[3] = SamplingParams(temperature=1.0)  # unseeded: global RNG
    params[4] = SamplingParams(temperature=0.0, seed=44)  # greedy: draws nothing
    streams = [_stream(p, i, steps, vocab) for i, p in enumerate(params)]
    sampler = Sampler()

    def run_alone(i: int) -> list[int]:
        gen = make_generator(params[i])
        tokens: list[int] = []
        for step in range(steps):
            out = sampler.sample(streams[i][step][None], [params[i]], _empty(), [gen])
            tokens.append(int(out.token_ids[0]))
        return tokens

    alone = {i: run_alone(i) for i in (0, 1, 2, 4)}
    gens = [make_generator(p) for p in params]
    together: dict[int, list[int]] = {i: [] for i in range(5)}
    order = list(range(5))
    shuffle = torch.Generator().manual_seed(5)
    for step in range(steps):
        order = [order[j] for j in torch.randperm(5, generator=shuffle).tolist()]
        batch = torch.stack([streams[i][step] for i in order])
        out = sampler.sample(batch, [params[i] for i in order], _empty(5), [gens[i] for i in order])
        for pos, i in enumerate(order):
            together[i].append(int(out.token_ids[pos]))
    for i in (0, 1, 2, 4):
        assert together[i] == alone[i], i
    # Same logits, different seeds: different draws.
    other = SamplingParams(temperature=0.9, top_p=0.95, seed=12)
    gen = make_generator(other)
    diff = [
        int(sampler.sample(streams[0][s][None], [other], _empty(), [gen]).token_ids[0])
        for s in range(steps)
    ]
    assert diff != alone[0]


def test_empirical_frequencies_after_top_p() -> None:
    draws = 4000
    probs = [0.4, 0.3, 0.2, 0.1]
    # Top-p 0.8 keeps ids 0, 1, 2 (mass before id 2 is 0.7 < 0.8) and renormalises.
    expected = torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0], dtype=torch.float64) * draws
    logits = _log(probs).repeat(draws, 1)
    torch.manual_seed(1234)
    params = [SamplingParams(top_p=0.8)] * draws
    out = Sampler().sample(logits, params, _empty(draws), [None] * draws)
    counts = torch.bincount(out.token_ids, minlength=4).double()
    assert counts[3] == 0
    chi2 = float(((counts[:3] - expected[:3]) ** 2 / expected[:3]).sum())
    assert chi2 < 13.8, (counts.tolist(), chi2)  # 2 degrees of freedom, p = 0.001

    # One seeded sequence drawing 1000 times from its own generator.
    gen = make_generator(SamplingParams(seed=3))
    row = _log(probs)[None]
    tokens = [
        int(Sampler().sample(row, [SamplingParams(seed=3)], _empty(), [gen]).token_ids[0])
        for _ in range(1000)
    ]
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    want = torch.tensor(probs, dtype=torch.float64) * 1000
    assert float(((counts - want) ** 2 / want).sum()) < 16.3  # 3 degrees of freedom, p = 0.001


def test_a_batch_without_logprobs_samples_alike_and_leaves_the_logits_alone() -> None:
    """No row asks for logprobs: no distribution is computed, the greedy rows still take
    the argmax, the sampled rows draw the same tokens as with logprobs asked (the
    distribution is read-only), and the caller's logits are never written, also when a
    row's penalty edits its copy in place."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen) * 4
    before = logits.clone()
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.7, top_k=5)] * 3
    gens = [None] * 3 + [torch.Generator().manual_seed(i) for i in range(3)]
    out = Sampler().sample(logits, params, _empty(6), gens)
    assert out.top_logprobs is None and out.logprobs is None
    assert out.token_ids[:3].tolist() == logits[:3].argmax(dim=1).tolist()
    asked = [SamplingParams(temperature=p.temperature, top_k=p.top_k, logprobs=0) for p in params]
    gens = [None] * 3 + [torch.Generator().manual_seed(i) for i in range(3)]
    again = Sampler().sample(logits, asked, _empty(6), gens)
    assert again.token_ids.tolist() == out.token_ids.tolist()
    assert torch.equal(logits, before)
    hist = [SeqHistory([int(t) for t in out.token_ids[:1]], []), *_empty(5)]
    edited = [SamplingParams(repetition_penalty=1.5), *params[1:]]
    Sampler().sample(logits, edited, hist, [None] * 6)
    assert torch.equal(logits, before)
