"""Parameter and KV byte accounting.

Oracles: shape formulas written out by hand from docs/design/architecture.md §1.1-1.9 (checked
on both presets), the ``numel`` of a real tiny model, and the byte arithmetic
of docs/design/architecture.md §1.10.
"""

from __future__ import annotations

import pytest

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.planning.accounting import account


def _hand_counts(c: ModelConfig) -> dict[str, int]:
    """Every accounting number from the published shapes, one formula per module."""
    D, V, hd, q, hc = c.hidden_size, c.vocab_size, c.head_dim, c.q_lora_rank, c.hc_mult
    H, G, ol = c.num_attention_heads, c.o_groups, c.o_lora_rank
    nI, dI, E, k, inter = (
        c.index_n_heads,
        c.index_head_dim,
        c.n_routed_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
    )
    cols = len(c.engram_orders) * c.engram_n_heads
    attn = q * D + q + H * hd * q + hd * D + hd + (G * ol) * (H * hd // G) + D * G * ol + H
    mhc = 2 * ((2 + hc) * hc * hc * D + (2 + hc) * hc + 3)
    dense_ffn = E * D + 2 * E + 3 * inter * D  # router weight, bias and bias_vl, shared expert
    expert = 3 * inter * D
    engram_rest = (hc + 1) * D * cols * c.engram_head_dim + 2 * hc * D  # wkv, q/k weights

    def compressor(l: int) -> int:
        if l not in c.kv_source_layer_ids:
            return 0
        return hd * D * (2 if c.compress_ratio(l) == 2 else 1) + hd

    def index_keys(l: int) -> int:  # wk, k_norm
        return dI * hd + dI if l in c.kv_source_layer_ids else 0

    def indexer(l: int) -> int:
        if l not in c.index_source_layer_ids:
            return 0
        return nI * dI * q + nI * D + index_keys(l)

    def engram(l: int) -> tuple[int, int]:  # (table, rest)
        if l not in c.engram_layer_ids:
            return 0, 0
        rows = c.engram_num_embeddings[c.engram_layer_ids.index(l)]
        return rows * c.engram_head_dim, engram_rest

    def active(l: int) -> int:
        common = attn + compressor(l) + indexer(l) + mhc + 2 * D + dense_ffn
        return common + k * expert + engram(l)[1]

    layers = range(c.num_hidden_layers)
    tables = sum(engram(l)[0] for l in layers)
    total = 2 * V * D + D + sum(active(l) + (E - k) * expert + engram(l)[0] for l in layers)
    b = c.ced_boundary
    kv_write = D + hd * D + hd + compressor(b) + index_keys(b) + engram(b)[1]
    return {
        "params_total": total,
        "params_engram": tables,
        "params_backbone": total - tables,
        "params_active_decode": 2 * V * D + D + sum(active(l) for l in layers),
        "params_active_prefill": V * D + sum(active(l) for l in range(b)) + kv_write,
    }


@pytest.mark.parametrize("preset", ["tiny", "official"])
def test_parameter_counts_match_the_hand_formulas(preset: str) -> None:
    config = ModelConfig.preset(preset)
    got = account(config).to_dict()
    for key, want in _hand_counts(config).items():
        assert got[key] == want, key


def test_official_targets() -> None:
    acc = account(ModelConfig.official())
    assert acc.global_kv_bytes_per_token == 890
    assert acc.persistent_kv_bytes_per_token == 890
    assert acc.swa_kv_bytes_per_request == 128 * 528 * 40 == 2_703_360
    assert abs(acc.params_active_prefill / 8e9 - 1) < 0.10
    assert abs(acc.params_active_decode / 16e9 - 1) < 0.10
    assert abs(acc.params_backbone / 552e9 - 1) < 0.05
    # Engram tables: 768,022,850 rows x 256 dims.
    assert acc.params_engram == (384006168 + 384016682) * 256


def test_tiny_counts_match_a_real_model() -> None:
    config = ModelConfig.tiny()
    acc = account(config)
    # Checkpoint names: the routed experts one by one (the model stores them stacked).
    params = DeepseekV41(config).state_dict()
    drafter = {n: p for n, p in params.items() if n.startswith("mtp.")}
    params = {n: p for n, p in params.items() if n not in drafter}
    # The DSpark drafter is counted on its own, outside the text model's total.
    assert drafter and acc.params_dspark == sum(p.numel() for p in drafter.values())
    assert acc.params_total == sum(p.numel() for p in params.values())
    assert acc.params_engram == sum(p.numel() for n, p in params.items() if "engram.embed" in n)
    for row in acc.layers:
        prefix = f"layers.{row.layer}."
        assert row.params == sum(p.numel() for n, p in params.items() if n.startswith(prefix))
        one_expert = sum(
            p.numel() for n, p in params.items() if n.startswith(prefix + "ffn.experts.0.")
        )
        table = sum(p.numel() for n, p in params.items() if n == prefix + "engram.embed.weight")
        unused = (config.n_routed_experts - config.num_experts_per_tok) * one_expert
        assert row.params_active == row.params - table - unused


def test_tiny_kv_bytes_and_roles() -> None:
    acc = account(ModelConfig.tiny())
    # Layer 2: ratio 2, (288 + 68) / 2; layer 4: ratio 1, 288 + 68.
    assert acc.global_kv_bytes_per_token == 178 + 356
    assert acc.swa_kv_bytes_per_request == 16 * 528 * 8
    roles = [row.role for row in acc.layers]
    assert roles == ["swa_only", "swa_only", "full", "reuse", "full", "reuse", "reindex", "reuse"]
    assert [row.stage for row in acc.layers] == ["encoder"] * 4 + ["boundary"] + ["decoder"] * 3
    assert [row.layer for row in acc.layers if row.engram] == [1, 2]
    assert [row.kv_source for row in acc.layers] == [None, None, 2, 2, 4, 4, 4, 4]
    assert [row.index_source for row in acc.layers] == [None, None, 2, 2, 4, 4, 6, 6]


def test_vision_parameters_are_counted_apart() -> None:
    """The release's tower by hand: 32 blocks of 1024 wide, a 9216 -> 5120 -> 5120 aligner."""
    official = account(ModelConfig.official())
    d, inter, blocks, patch_dim, hidden = 1024, 2816, 32, 588, 5120
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + d * 2 * inter + inter * d
    vit = patch_dim * d + d + blocks * block + d
    aligner = 9 * d * hidden + hidden + hidden * hidden + hidden
    assert official.params_vision == vit + aligner + 3 * hidden
    # Not part of the text model's counts, so those stay what they were.
    text_only = ModelConfig.official()
    text_only = text_only.replace(
        extra={k: v for k, v in text_only.extra.items() if k != "vision_config"}
    )
    plain = account(text_only)
    assert plain.params_vision == 0
    assert plain.params_total == official.params_total
    assert plain.params_active_decode == official.params_active_decode
