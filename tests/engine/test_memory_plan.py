"""The memory plan against a hand computation from the config's numbers.

The plan takes its shapes from the model built on ``meta`` (engine.accounting);
the expected bytes here are written out from the config fields and the
release's storage formats instead, so the two paths are independent.
"""

from __future__ import annotations

import math

import pytest

from engine.memory_plan import GIB, PlanError, memory_plan, weight_bytes
from engine.model.config import ModelConfig


def _hand_bytes(c: ModelConfig, experts_on_device: int) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes on one device by kind, Engram host bytes by kind), from the config alone."""
    H, L, E, I = c.hidden_size, c.num_hidden_layers, c.n_routed_experts, c.moe_intermediate_size
    nh, d, q, g, o = (
        c.num_attention_heads,
        c.head_dim,
        c.q_lora_rank,
        c.o_groups,
        c.o_lora_rank,
    )
    ih, idim, hc = c.index_n_heads, c.index_head_dim, c.hc_mult
    kv = c.kv_source_layer_ids
    ratio2_kv = [s for s in kv if c.compress_ratio(s) == 2]  # only they gate overlapping windows
    n_index, n_engram = len(c.index_source_layer_ids), len(c.engram_layer_ids)
    engram_in = len(c.engram_orders) * c.engram_n_heads * c.engram_head_dim

    # FP8 E4M3, 1 B/param: every (rows, cols) of a block-quantised projection.
    fp8 = (
        [(q, H), (nh * d, q), (d, H), (g * o, nh * d // g), (H, g * o)] * L  # attention
        + [(I, H), (H, I), (I, H)] * L  # shared expert w1, w2, w3
        + [(ih * idim, q)] * n_index  # indexer query
        + [((1 + hc) * H, engram_in)] * n_engram  # Engram value/key projection
    )
    dense_fp8 = sum(r * k for r, k in fp8)
    dense_scales = sum(math.ceil(r / 32) * math.ceil(k / 32) for r, k in fp8)  # 1 B / 32x32
    expert_params = experts_on_device * L * 3 * I * H  # w1, w2, w3 of each routed expert
    bf16_proj = 2 * (
        len(kv) * d * H  # compressor wkv
        + len(ratio2_kv) * d * H  # compressor wgate
        + len(kv) * idim * d  # indexer key projection
        + n_index * ih * H  # indexer head weights
        + L * E * H  # router
        + n_engram * 2 * hc * H  # Engram q/k gates
    )
    mhc = (2 + hc) * hc * (hc * H) + (2 + hc) * hc + 3  # fn, base, scale of one sublayer
    fp32_small = 4 * (
        L * (nh + d + q + 2 * H + 2 * E + 2 * mhc)  # sink, kv/q/attn/ffn norms, biases, mHC
        + len(kv) * (d + idim)  # compressor norm, indexer key norm
        + H  # final norm
    )
    device = {
        "dense_fp8": dense_fp8,
        "dense_fp8_scales": dense_scales,
        "experts_fp4": expert_params // 2,  # two E2M1 per byte
        "experts_fp4_scales": expert_params // 32,  # one E8M0 per 32
        "bf16_projections": bf16_proj,
        "norms_mhc_sinks_biases": fp32_small,
        "embed_head": 2 * c.vocab_size * H * 2,  # bf16
    }
    table_params = sum(c.engram_num_embeddings) * c.engram_head_dim
    host = {"engram_fp8": table_params, "engram_scales": table_params // 32}
    return device, host


def test_official_plan_on_8_devices_matches_the_hand_computation() -> None:
    c = ModelConfig.official()
    plan = memory_plan(c, 8, 141 * GIB)
    device, host = _hand_bytes(c, experts_on_device=384 // 8)
    assert len(plan.device_kinds) == 1
    d = plan.device_kinds[0]
    assert (d.devices, d.experts) == (list(range(8)), 48)
    assert d.weights == device
    assert plan.host == host
    # A few figures spelled out, so a wrong formula above cannot agree with itself.
    assert device["experts_fp4"] == 48 * 40 * 3 * 2304 * 5120 // 2 == 33_973_862_400
    assert host["engram_fp8"] == (384_006_168 + 384_016_682) * 256 == 196_613_849_600

    # Reserve (docs/design/memory-plan.md): 2 GiB runtime + 8 fp32 buffers of
    # 2048 rows x (4 x 5120) + fp32 logits of 64 rows; SWA KV of 64 sequences.
    reserve = 2 * GIB + 8 * 2048 * 4 * 5120 * 4 + 64 * 129280 * 4
    swa = 64 * 128 * 528 * 40  # window x MXFP8 record x layers
    weights = sum(device.values())
    left = 141 * GIB - weights - reserve - swa
    page_bytes = 64 * 890  # 890 B/token, 64 tokens a page
    assert (d.weights_bytes, d.reserve_bytes, d.swa_kv_bytes) == (weights, reserve, swa)
    assert (plan.kv_bytes_per_token, plan.page_bytes) == (890, page_bytes)
    assert d.kv_pool_bytes == left
    assert d.kv_pool_tokens == left // page_bytes * 64
    assert plan.kv_pool_tokens_total == 8 * d.kv_pool_tokens
    assert plan.fits and plan.refusal() is None and d.shortfall_bytes == 0


def test_official_on_one_device_is_refused_naming_the_shortfall() -> None:
    c = ModelConfig.official()
    plan = memory_plan(c, 1, 141 * GIB)
    device, _ = _hand_bytes(c, experts_on_device=384)
    need = sum(device.values())
    assert plan.device_kinds[0].weights_bytes == need
    assert not plan.fits
    assert plan.refusal() == (
        f"weights need {need / GIB:.1f} GiB per device, 141.0 GiB available: use more devices"
    )
    assert plan.device_kinds[0].kv_pool_tokens == 0


def test_uneven_expert_split_gives_two_device_kinds() -> None:
    c = ModelConfig.official()
    plan = memory_plan(c, 5, 141 * GIB)
    kinds = [(k.devices, k.experts) for k in plan.device_kinds]
    assert kinds == [([0, 1, 2, 3], 77), ([4], 76)]  # 384 = 4 x 77 + 76
    whole = weight_bytes(c)
    held = sum(k.weights["experts_fp4"] * len(k.devices) for k in plan.device_kinds)
    assert held == whole.per_expert["experts_fp4"] * 384  # every expert on exactly one device


def test_reserve_that_does_not_fit_is_refused() -> None:
    plan = memory_plan(ModelConfig.tiny(), 1, 1 * GIB)  # tiny weights fit, 2 GiB reserve not
    assert plan.device_kinds[0].weights_bytes < GIB
    message = plan.refusal()
    assert message is not None and "activation reserve" in message
    assert "lower --max-num-batched-tokens" in message
    assert plan.device_kinds[0].shortfall_bytes > 0


@pytest.mark.parametrize(("devices", "memory"), [(0, 141 * GIB), (385, 141 * GIB), (1, 0)])
def test_bad_arguments_are_refused(devices: int, memory: int) -> None:
    with pytest.raises(PlanError):
        memory_plan(ModelConfig.tiny() if devices < 9 else ModelConfig.official(), devices, memory)
