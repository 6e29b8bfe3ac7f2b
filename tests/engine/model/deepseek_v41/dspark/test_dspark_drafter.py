"""The drafter's block round against the float64 reference (dspark_reference.py)."""

from __future__ import annotations

import dspark_reference as ref
import pytest
import torch

from engine.model.deepseek_v41.config import ConfigError, ModelConfig
from engine.model.deepseek_v41.dspark.config import drafter_config
from engine.model.deepseek_v41.model import DeepseekV41


def test_names_are_the_release_layout(model64: DeepseekV41) -> None:
    names = [n for n in model64.state_dict() if n.startswith("mtp.")]
    assert "mtp.0.main_proj.weight" in names and "mtp.0.main_norm.weight" in names
    assert "mtp.1.markov_head.embed.weight" in names
    assert "mtp.1.markov_head.head.weight" in names
    assert "mtp.1.confidence_head.proj.weight" in names
    assert "mtp.1.norm.weight" in names and "mtp.0.norm.weight" not in names
    # Both stages are whole blocks: shared expert and all the drafter's routed experts.
    for s in (0, 1):
        assert f"mtp.{s}.ffn.shared_experts.w2.weight" in names
        assert f"mtp.{s}.ffn.experts.3.w3.weight" in names
        assert f"mtp.{s}.ffn.experts.4.w3.weight" not in names  # dspark_n_routed_experts = 4
        assert not any(n.startswith(f"mtp.{s}.attn.compressor") for n in names)
        assert not any(n.startswith(f"mtp.{s}.attn.indexer") for n in names)
    sd = model64.state_dict()
    cfg = model64.config
    assert sd["mtp.0.main_proj.weight"].shape == (cfg.hidden_size, 2 * cfg.hidden_size)
    assert sd["mtp.1.markov_head.head.weight"].shape == (cfg.vocab_size, cfg.dspark_markov_rank)
    assert sd["mtp.1.confidence_head.proj.weight"].shape == (
        1,
        cfg.hidden_size + cfg.dspark_markov_rank,
    )


def test_block_round_matches_float64_reference(model64: DeepseekV41) -> None:
    cfg, drafter = model64.config, model64.dspark
    assert drafter is not None
    g = torch.Generator().manual_seed(1)
    rows = 9
    feats = {
        l: torch.randn(rows, cfg.hc_mult, cfg.hidden_size, generator=g, dtype=torch.float64)
        for l in cfg.dspark_target_layer_ids
    }
    pos = torch.arange(3, 3 + rows)
    w = ref.state(model64)
    mx = ref.main_x(w, [feats[l] for l in cfg.dspark_target_layer_ids], cfg)
    got_mx = drafter.context(feats)
    torch.testing.assert_close(got_mx, mx, rtol=1e-9, atol=1e-9)
    rings_ref = [ref.ring_kv(w, s, mx, pos, cfg) for s in range(2)]
    rings = drafter.context_kv(got_mx, pos)
    for s, l in enumerate(drafter.layer_ids):
        torch.testing.assert_close(rings[l], rings_ref[s], rtol=1e-6, atol=1e-6)
    anchor, position = 17, 3 + rows
    tokens, logits, conf = ref.draft(w, cfg, anchor, position, rings_ref)
    out = drafter.draft(anchor, position, rings, model64.embed, model64.head)
    torch.testing.assert_close(out.logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.confidence, conf, rtol=1e-6, atol=1e-6)
    assert out.tokens.tolist() == tokens.tolist()
    # The Markov chain is the only link between slots: the noise slots' base logits
    # are not all equal, and the chain changes tokens against a plain argmax somewhere.
    assert len(set(tokens.tolist())) > 1


def test_markov_bias_follows_the_predecessor(model64: DeepseekV41) -> None:
    """Slot j's logits = base_j + bias(token j-1): changing the anchor changes slot 0's bias."""
    cfg, drafter = model64.config, model64.dspark
    assert drafter is not None
    last = drafter.stages[-1]
    assert last.markov_head is not None
    empty = {l: torch.zeros(0, cfg.head_dim, dtype=torch.float64) for l in drafter.layer_ids}
    base, _ = drafter([5], [0], [empty], model64.embed, model64.head)
    out = drafter.draft(5, 0, empty, model64.embed, model64.head)
    prev = [5, *out.tokens.tolist()[:-1]]
    w = model64.state_dict()
    for j, p in enumerate(prev):
        bias = w["mtp.1.markov_head.head.weight"] @ w["mtp.1.markov_head.embed.weight"][p]
        torch.testing.assert_close(out.logits[j], base[j] + bias, rtol=1e-9, atol=1e-9)


def test_a_batch_of_rounds_is_each_round_alone(model64: DeepseekV41) -> None:
    """``draft_many`` over three sequences (rings of 0, 4 and 9 rows, other anchors and
    positions) gives each sequence's ``draft`` alone: the block-diagonal mask keeps a
    row to its own ring and block (float64)."""
    cfg, drafter = model64.config, model64.dspark
    assert drafter is not None
    gen = torch.Generator().manual_seed(3)

    def ring(rows: int) -> dict[int, torch.Tensor]:
        return {
            l: torch.randn(rows, cfg.head_dim, generator=gen, dtype=torch.float64)
            for l in drafter.layer_ids
        }

    rings, anchors, positions = [ring(0), ring(4), ring(9)], [5, 11, 40], [0, 4, 9]
    many = drafter.draft_many(anchors, positions, rings, model64.embed, model64.head)
    for i, got in enumerate(many):
        alone = drafter.draft(anchors[i], positions[i], rings[i], model64.embed, model64.head)
        assert got.tokens.tolist() == alone.tokens.tolist()
        torch.testing.assert_close(got.logits, alone.logits, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got.confidence, alone.confidence, rtol=1e-10, atol=1e-10)
    assert many[0].tokens.tolist() != many[2].tokens.tolist()  # the rounds do differ


def test_config_refusals() -> None:
    tiny = ModelConfig.tiny()
    import dataclasses

    with pytest.raises(ConfigError, match="dspark_noise_token_id"):
        drafter_config(dataclasses.replace(tiny, dspark_noise_token_id=tiny.vocab_size))
    with pytest.raises(ConfigError, match="dspark_target_layer_ids"):
        drafter_config(dataclasses.replace(tiny, dspark_target_layer_ids=[8]))
    with pytest.raises(ConfigError, match="compress_ratios"):
        drafter_config(dataclasses.replace(tiny, compress_ratios=[*tiny.compress_ratios[:-1], 1]))
    # The model of such a config is the text model alone, said in a warning.
    bad = dataclasses.replace(tiny, vocab_size=512)
    assert DeepseekV41(bad).dspark is None
    none = dataclasses.replace(
        tiny, num_nextn_predict_layers=0, compress_ratios=tiny.compress_ratios[:-1]
    )
    assert drafter_config(none) is None and DeepseekV41(none).dspark is None
