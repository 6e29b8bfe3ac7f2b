"""The dense reference forward: semantics, CSA2 roles and replay rules.

Oracles: causality (a prefix's logits cannot depend on later tokens), the
encoder's exactness under CED (global KV equal to the exact forward's), the
restore rule (a restore equals the cold prefill; tokens below the replay
triangle matter only through stored KV), and the per-layer selections recorded
by ``trace`` checked against the spec's rules.
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.model.deepseek_v41.config import LayerRole
from engine.model.deepseek_v41.reference import (
    GlobalKV,
    KVPrecision,
    ReplayPlan,
    forward,
    forward_exact,
    reference_generate,
)
from kernels.kv_formats import fake_quant_index_key, fake_quant_main_kv

N = 45  # > candidate_topk_blocks * candidate_block_size = 32 entries at the ratio-1 source


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(3, 120000, (N,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def exact(tiny_model, ids):
    trace: dict = {}
    out = forward(tiny_model, ids, ReplayPlan.exact(tiny_model.config), trace=trace)
    return out, trace


def _ratios(config):
    return {l: config.compress_ratios[l] for l in config.kv_source_layer_ids}


UNQUANTISED = KVPrecision("exact", "exact")


def test_exact_logits_are_causal(tiny_model, ids, exact):
    """A prefix's logits never depend on later tokens (every mask and visibility rule).

    Without KV quantisation the only differences are fp32 GEMM rounding (MKL
    takes another kernel below 16 rows). With it, that 1e-7 noise can move a
    value across an FP8/FP4 rounding boundary, a ~1e-3 jump in the logits: the
    quantised comparison is therefore looser (docs/design/semantics.md).
    """
    full = exact[0].logits
    assert full.shape == (N, tiny_model.config.vocab_size)
    assert torch.isfinite(full).all()
    plain = forward(tiny_model, ids, precision=UNQUANTISED).logits
    for k in (1, 2, 3, 17, 33):
        prefix = forward(tiny_model, ids[:k], precision=UNQUANTISED).logits
        torch.testing.assert_close(prefix, plain[:k], atol=2e-5, rtol=1e-5)
        quantised = forward_exact(tiny_model, ids[:k])
        torch.testing.assert_close(quantised, full[:k], atol=2e-2, rtol=0)


def test_compressed_entries_and_selections_follow_visibility(tiny_model, exact):
    config = tiny_model.config
    out, trace = exact
    for l, ratio in _ratios(config).items():
        assert out.global_kv.latents[l].shape == (N // ratio, config.head_dim)
        assert out.global_kv.keys[l].shape == (N // ratio, config.index_head_dim)
    for l, idx in trace["topk"].items():
        ratio = config.compress_ratios[l]
        pos = trace["pos"][l]
        n_visible = (pos + 1) // ratio
        assert idx.shape == (pos.shape[0], config.index_topk)
        valid = idx >= 0
        # Never an entry the query cannot see yet; padding only when too few are visible.
        assert bool((idx[valid] < n_visible.unsqueeze(1).expand_as(idx)[valid]).all())
        expected = torch.clamp(n_visible, max=config.index_topk)
        assert torch.equal(valid.sum(1), expected)
        assert bool((idx[~valid] == -1).all())
        # Each selected entry once.
        for row in idx:
            chosen = row[row >= 0]
            assert chosen.unique().numel() == chosen.numel()


def test_reuse_layers_take_their_index_source_selection(tiny_model, exact):
    config = tiny_model.config
    _, trace = exact
    reuse = [l for l in range(config.num_hidden_layers) if config.role(l) is LayerRole.REUSE]
    assert reuse, "the tiny preset must have Reuse layers"
    for l in reuse:
        assert torch.equal(trace["topk"][l], trace["topk"][config.index_source(l)])


def test_reindex_layers_select_inside_candidate_blocks(tiny_model, exact):
    config = tiny_model.config
    _, trace = exact
    reindex = [l for l in range(config.num_hidden_layers) if config.role(l) is LayerRole.REINDEX]
    assert reindex
    cand_src = config.candidate_source_layer_id
    filtered_somewhere = False
    for l in reindex:
        idx, cand = trace["topk"][l], trace["candidates"][l]
        pos = trace["pos"][l]
        n_visible = (pos + 1) // config.compress_ratios[l]
        for t in range(idx.shape[0]):
            chosen = idx[t][idx[t] >= 0]
            assert bool(cand[t, chosen].all()), "Reindex picked outside the candidate blocks"
            newest = int(n_visible[t]) - 1
            assert bool(cand[t, newest]), "the newest visible entry's block is always kept"
            n_cand = int(cand[t].sum())
            assert chosen.numel() == min(config.index_topk, n_cand)
            limit = config.candidate_topk_blocks * config.candidate_block_size
            if int(n_visible[t]) > limit:
                filtered_somewhere = True
                assert n_cand <= limit
            else:
                assert n_cand == int(n_visible[t])
        # Reindex differs from reusing the candidate source's own top-k.
        assert not torch.equal(idx, trace["topk"][cand_src])
    assert filtered_somewhere, "N is chosen so the candidate filter is active"


def test_stored_kv_is_quantised(exact):
    kv: GlobalKV = exact[0].global_kv
    for l, t in kv.latents.items():
        torch.testing.assert_close(fake_quant_main_kv(t), t, atol=0, rtol=0)
        torch.testing.assert_close(fake_quant_index_key(kv.keys[l]), kv.keys[l], atol=0, rtol=0)


def test_precision_exact_changes_little_but_does_change(tiny_model, ids, exact):
    plain = forward(tiny_model, ids, precision=UNQUANTISED).logits
    quant = exact[0].logits
    assert not torch.equal(plain, quant)
    p, q = torch.log_softmax(plain, -1), torch.log_softmax(quant, -1)
    kl = (p.exp() * (p - q)).sum(-1).mean()
    assert float(kl) < 0.05


def test_ced_prefill_writes_exact_global_kv(tiny_model, ids, exact):
    config = tiny_model.config
    W = config.sliding_window
    ced = forward(tiny_model, ids, ReplayPlan.prefill(config, N, W))
    assert ced.logits.shape[0] == W  # only the replayed rows reach the head
    for l in config.kv_source_layer_ids:
        torch.testing.assert_close(ced.global_kv.latents[l], exact[0].global_kv.latents[l])
        torch.testing.assert_close(ced.global_kv.keys[l], exact[0].global_kv.keys[l])
    # The decoder saw truncated windows, so the last logits differ from exact.
    assert not torch.allclose(ced.logits[-1], exact[0].logits[-1], atol=1e-4)


def test_full_depth_prefill_plans_the_exact_forward(tiny_config):
    """--disable-ced without a hit runs every layer on every row: the exact plan.
    (The engine test test_full_depth_equals_the_exact_reference runs it.)"""
    assert ReplayPlan.prefill(tiny_config, N, 16, ced=False) == ReplayPlan.exact(tiny_config)
    # With a hit of 32 (L = 45, sliding window 16): the last layer's query side
    # runs from H; each layer below starts one window (15 rows) earlier.
    with_hit = ReplayPlan.prefill(tiny_config, N, 16, stored_tokens=32, ced=False)
    assert with_hit.starts == (0, 0, 0, 0, 0, 0, 2, 17, 32)


def test_restore_plan_is_a_triangle_below_the_decoder(tiny_config):
    """CED, L = 120, H = 96, W = 16, B = 4: d0 = 104; layer B's keys from d0 - 15 = 89;
    each encoder layer one window (15 rows) earlier."""
    plan = ReplayPlan.prefill(tiny_config, 120, 16, stored_tokens=96)
    assert plan.starts == (29, 44, 59, 74, 89, 104, 104, 104, 104)
    assert plan.encoder_start == 29 and plan.decoder_start(tiny_config) == 104
    # A suffix shorter than the window: d0 = 84 < H, so the decoder's first row
    # reads layer B's keys from 69, below H, and the triangle hangs below that.
    assert ReplayPlan.prefill(tiny_config, 100, 16, stored_tokens=96).starts == (
        9,
        24,
        39,
        54,
        69,
        84,
        84,
        84,
        84,
    )
    # Prefill-only (no logits): layer B's global KV from H, nothing past it.
    only = ReplayPlan.prefill(tiny_config, 120, 16, stored_tokens=96, need_logits=False)
    assert only.starts == (36, 51, 66, 81, 96, 120, 120, 120, 120)


@pytest.fixture(scope="module")
def model64(tiny_model):
    return copy.deepcopy(tiny_model).double()


@pytest.mark.parametrize("ced", [True, False])
@pytest.mark.parametrize("H", [16, 64, 96, 112])
def test_restore_equals_the_cold_prefill(model64, H, ced):
    """A hit of H tokens (global KV from the store) gives the cold run's logits, for
    suffixes shorter and longer than the window (float64: to rounding)."""
    config = model64.config
    ids = torch.randint(3, 120000, (120,), generator=torch.Generator().manual_seed(3))
    W = config.sliding_window
    cold = forward(model64, ids, ReplayPlan.prefill(config, 120, W, ced=ced))
    stored = cold.global_kv.prefix(H, _ratios(config))
    plan = ReplayPlan.prefill(config, 120, W, stored_tokens=H, ced=ced)
    restored = forward(model64, ids, plan, stored)
    rows = restored.logits.shape[0]
    torch.testing.assert_close(restored.logits, cold.logits[-rows:], atol=1e-9, rtol=0)
    for l in config.kv_source_layer_ids:
        torch.testing.assert_close(restored.global_kv.latents[l], cold.global_kv.latents[l])


def test_restore_reads_nothing_below_the_triangle(tiny_model):
    """Tokens below the plan's first row (minus Engram's n-gram history) matter only
    via stored KV; a token inside the replayed rows does matter."""
    config = tiny_model.config
    ids = torch.randint(3, 120000, (120,), generator=torch.Generator().manual_seed(5))
    H, W = 96, 16
    stored = forward(tiny_model, ids).global_kv.prefix(H, _ratios(config))
    plan = ReplayPlan.prefill(config, 120, W, stored_tokens=H)
    base = forward(tiny_model, ids, plan, stored)
    changed = ids.clone()
    history = config.engram_max_ngram_size - 1
    changed[: plan.encoder_start - history] = 5
    other = forward(tiny_model, changed, plan, stored)
    torch.testing.assert_close(other.logits, base.logits, atol=0, rtol=0)
    changed[plan.encoder_start] = 6
    assert not torch.equal(forward(tiny_model, changed, plan, stored).logits, base.logits)


def test_reference_generate_is_greedy_under_fixed_plan(tiny_model, ids):
    prompt = ids[:30].tolist()
    res = reference_generate(tiny_model, prompt, 3)
    assert res.plan == ReplayPlan.prefill(tiny_model.config, 30, tiny_model.config.sliding_window)
    for i, tok in enumerate(res.tokens):
        assert tok == int(torch.argmax(res.logits[i]))
    # Step 2 recomputes everything with the admission plan (decoder rows from d0).
    seq = torch.tensor(prompt + res.tokens[:2])
    again = forward(tiny_model, seq, res.plan).logits[-1]
    torch.testing.assert_close(again, res.logits[2])
