"""bench/quality.py's arithmetic (hand values) and row alignment (a plan that replays the
whole prompt must score exactly like the exact forward)."""

from __future__ import annotations

import math

import pytest
import torch

from bench.quality import SECTIONS, Tally, _Tallies, dense_indexer, ppl_ratio, run_window
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41


def test_tally_perplexity_and_kl_by_hand() -> None:
    reference = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    variant = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]))
    targets = torch.tensor([0, 1])
    tally = Tally()
    tally.add(variant, reference, targets)
    assert tally.ppl == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.8)) / 2))
    kl_row0 = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)
    assert tally.mean_kl == pytest.approx(kl_row0 / 2)


def test_ppl_ratio_over_windows() -> None:
    base, variant = Tally([2.0, 4.0], [0, 0], [2, 2]), Tally([2.2, 4.6], [0, 0], [2, 2])
    rel, err = ppl_ratio(variant, base)
    # Per-token NLL differences 0.1 and 0.3: mean 0.2, sample sd 0.1 * sqrt(2), s.e. 0.1.
    assert rel == pytest.approx(math.exp(0.2) - 1)
    assert err == pytest.approx(2 * 0.1 * math.exp(0.2))


def test_dense_indexer_lifts_and_restores_the_limits() -> None:
    model = DeepseekV41(ModelConfig.tiny().replace(vocab_size=64))
    original = model.config
    with dense_indexer(model, topk=True, candidates=False):
        assert model.config.index_topk == original.index_topk
        assert model.config.candidate_topk_blocks * 8 >= original.max_position_embeddings
    with dense_indexer(model, topk=False, candidates=False):
        assert model.config.index_topk == original.max_position_embeddings
        # What the forward reads: each layer's attention (it was the config alone once,
        # and the forward then ran the limits unchanged).
        assert all(b.attn.index_topk == original.max_position_embeddings for b in model.blocks)
    assert model.config is original
    assert all(b.attn.index_topk == original.index_topk for b in model.blocks)


def test_plans_replaying_everything_score_like_the_exact_forward() -> None:
    # window 16 >= prompt 12 and >= stored 8: CED and restore rows are exact rows.
    model = DeepseekV41(ModelConfig.tiny().replace(vocab_size=64))
    model.init_weights(torch.Generator().manual_seed(0), std=0.1)
    ids = torch.randint(3, 64, (24,), generator=torch.Generator().manual_seed(0))
    tallies = {k: _Tallies() for k in SECTIONS}
    run_window(model.eval(), ids, prompt=12, stored_tokens=8, tallies=tallies)
    exact_ppl = tallies["b"]["full depth (= exact)"].ppl
    for key, name in [
        ("b", "CED, replay W=16"),
        ("b", "CED, replay W=32"),
        ("c", "restore H=8, W=16"),
        ("c", "recompute (CED prefill), W=16"),
    ]:
        assert tallies[key][name].mean_kl == pytest.approx(0.0, abs=1e-9), name
        assert tallies[key][name].ppl == pytest.approx(exact_ppl, rel=1e-9), name
    assert sum(tallies["b"]["CED, replay W=16"].rows) == 12  # rows 11..22 predict 12..23
    # Stored formats do change the numbers (the test would see a misaligned slice too).
    assert tallies["a"]["FP4 global KV + FP8 SWA (stored formats)"].mean_kl > 0
