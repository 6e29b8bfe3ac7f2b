"""The memory plan against a hand computation from the config's numbers.

The plan takes its shapes from the model built on ``meta`` (engine.planning.accounting);
the expected bytes here are written out from the config fields and the
release's storage formats instead, so the two paths are independent.
"""

from __future__ import annotations

import math

import pytest

from engine.model.deepseek_v41.config import ModelConfig
from engine.planning.memory_plan import GIB, PlanError, Topology, memory_plan, weight_bytes


def _hand_bytes(
    c: ModelConfig, experts_on_device: int, tp: int = 1
) -> tuple[dict[str, int], dict[str, int]]:
    """(bytes on one rank by kind, Engram host bytes by kind), from the config alone.

    ``tp``: what tensor parallelism splits (query heads, the wo_a groups, wo_b's
    input, the shared expert's intermediate, the sinks) counts one tp-th.
    """
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
    fp8_tp = (
        [(nh * d // tp, q), (g * o // tp, nh * d // g), (H, g * o // tp)] * L  # wq_b, wo_a, wo_b
        + [(I // tp, H), (H, I // tp), (I // tp, H)] * L  # shared expert w1, w2, w3
    )
    fp8 = (
        [(q, H), (d, H)] * L  # wq_a, the latent KV wkv: replicated
        + [(ih * idim, q)] * n_index  # indexer query
        + [((1 + hc) * H, engram_in)] * n_engram  # Engram value/key projection
    )
    dense_scales = sum(math.ceil(r / 32) * math.ceil(k / 32) for r, k in fp8 + fp8_tp)
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
        L * (nh // tp + d + q + 2 * H + 2 * E + 2 * mhc)  # sink, kv/q/attn/ffn norms, biases, mHC
        + len(kv) * (d + idim)  # compressor norm, indexer key norm
        + H  # final norm
    )
    device = {
        "dense_fp8_tp": sum(r * k for r, k in fp8_tp),
        "dense_fp8": sum(r * k for r, k in fp8),
        "dense_fp8_scales": dense_scales,
        "experts_fp4": expert_params // 2,  # two E2M1 per byte
        "experts_fp4_scales": expert_params // 32,  # one E8M0 per 32
        "bf16_projections": bf16_proj,
        "norms_mhc_sinks_biases": fp32_small,
        "embed_head": 2 * c.vocab_size * H * 2,  # bf16
        "dspark": 0,
    }
    if "vision_config" in c.extra:  # the release's tower: 32 blocks of 1024, bf16; norms fp32
        v, vi, blocks = 1024, 2816, 32
        block = v * 3 * v + 3 * v + v * v + v + v * 2 * vi + vi * v  # wqkv, wo (+biases), w1, w2
        aligner = 9 * v * H + H + H * H + H
        bf16 = 588 * v + v + blocks * block + aligner
        fp32 = blocks * 2 * v + v + 3 * H  # norm1, norm2, final norm; the span vectors
        device["vision"] = 2 * bf16 + 4 * fp32
    # The DSpark stages, whole, as stored: a single-process model holds them (no EP).
    if c.num_nextn_predict_layers and experts_on_device == c.n_routed_experts:
        En, n, r = c.dspark_n_routed_experts, c.num_nextn_predict_layers, c.dspark_markov_rank
        stage_fp8 = [(nh * d, q), (g * o, nh * d // g), (H, g * o), (I, H), (H, I), (I, H)]
        stage_fp8 += [(q, H), (d, H)]  # wq_b, wo_a, wo_b, shared expert; wq_a, wkv
        fp8_all = stage_fp8 * n + [(H, len(c.dspark_target_layer_ids) * H)]  # + main_proj
        fp8_bytes = sum(rr * k + math.ceil(rr / 32) * math.ceil(k / 32) for rr, k in fp8_all)
        experts = n * En * 3 * I * H
        small = n * (nh + d + q + 2 * H + 2 * En + 2 * mhc) + 2 * H  # + main_norm, norm
        heads = c.vocab_size * r * (2 + 4) + 4 * (H + r)  # Markov codes bf16, bias fp32; conf.
        device["dspark"] = (
            fp8_bytes + experts // 2 + experts // 32 + n * En * H * 2 + 4 * small + heads
        )
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
    assert device["vision"] == 970_700_800  # replicated on every device

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


# ----------------------------------------------------------------- topology

# Reserve and SWA KV of one rank at the defaults (2048 rows, 64 sequences per DP group).
_RESERVE = 2 * GIB + 8 * 2048 * 4 * 5120 * 4 + 64 * 129280 * 4
_SWA = 64 * 128 * 528 * 40
_PAGE = 64 * 890


def _pool_tokens(memory: int, weights: int) -> int:
    return (memory - weights - _RESERVE - _SWA) // _PAGE * 64


def test_official_dp8_ep8_and_tp8_ep8_on_8_x_141() -> None:
    c = ModelConfig.official()
    mem = 141 * GIB
    dp = memory_plan(c, 8, mem, topology=Topology(1, 8, expert_parallel=True))
    tp = memory_plan(c, 8, mem, topology=Topology(8, 1, expert_parallel=True))
    assert dp.topology.name == "DP8 x EP8" and tp.topology.name == "TP8 x EP8"
    dp_bytes, _ = _hand_bytes(c, experts_on_device=48)
    tp_bytes, _ = _hand_bytes(c, experts_on_device=48, tp=8)
    ((dk,), (tk,)) = dp.device_kinds, tp.device_kinds
    assert (dk.devices, dk.experts, tk.devices, tk.experts) == (list(range(8)), 48) * 2
    assert dk.weights == dp_bytes and tk.weights == tp_bytes
    # Spelled out: per layer wq_b 32768/8 x 1280, wo_a 8192/8 x 4096, wo_b 5120 x 8192/8,
    # shared expert 3 x 2304/8 x 5120; the latent wkv (512 x 5120) and wq_a stay whole.
    assert tp_bytes["dense_fp8_tp"] == 40 * (
        4096 * 1280 + 1024 * 4096 + 5120 * 1024 + 3 * 288 * 5120
    )
    assert tp_bytes["dense_fp8_tp"] * 8 == dp_bytes["dense_fp8_tp"] == 6_113_198_080
    assert tp_bytes["dense_fp8"] == dp_bytes["dense_fp8"]  # replicated either way
    assert tp_bytes["experts_fp4"] == dp_bytes["experts_fp4"] == 33_973_862_400
    # Node KV: DP sums 8 pools (a sequence on one rank); TP holds one (replicated 8 times).
    dp_tokens = _pool_tokens(mem, sum(dp_bytes.values()))
    tp_tokens = _pool_tokens(mem, sum(tp_bytes.values()))
    assert (dk.kv_pool_tokens, tk.kv_pool_tokens) == (dp_tokens, tp_tokens)
    assert dp.kv_tokens_per_node == [8 * dp_tokens] and dp.kv_pool_tokens_total == 8 * dp_tokens
    assert tp.kv_tokens_per_node == [tp_tokens] and tp.kv_pool_tokens_total == tp_tokens
    assert tp_tokens > dp_tokens  # TP frees weight bytes per rank, but not 8x the KV
    assert dp.fits and tp.fits


def test_official_on_16_x_80_over_two_nodes() -> None:
    c = ModelConfig.official()
    mem = 80 * GIB
    dp = memory_plan(c, 16, mem, topology=Topology(1, 16, True, nnodes=2))
    tp = memory_plan(c, 16, mem, topology=Topology(8, 2, True, nnodes=2))
    assert tp.topology.name == "TP8 x DP2 x EP16"
    dp_bytes, host = _hand_bytes(c, experts_on_device=24)
    tp_bytes, _ = _hand_bytes(c, experts_on_device=24, tp=8)
    assert dp.device_kinds[0].weights == dp_bytes and tp.device_kinds[0].weights == tp_bytes
    assert dp_bytes["experts_fp4"] == 24 * 40 * 3 * 2304 * 5120 // 2 == 16_986_931_200
    dp_tokens = _pool_tokens(mem, sum(dp_bytes.values()))
    tp_tokens = _pool_tokens(mem, sum(tp_bytes.values()))
    assert dp.kv_tokens_per_node == [8 * dp_tokens] * 2
    assert tp.kv_tokens_per_node == [tp_tokens] * 2  # one TP group per node
    assert (dp.kv_pool_tokens_total, tp.kv_pool_tokens_total) == (16 * dp_tokens, 2 * tp_tokens)
    assert dp.host == tp.host == host  # the Engram tables once per node, either way
    assert dp.fits and tp.fits


def test_no_expert_parallelism_on_8_x_141_is_refused_naming_the_shortfall() -> None:
    c = ModelConfig.official()
    plan = memory_plan(c, 8, 141 * GIB, topology=Topology(1, 8, expert_parallel=False))
    device, _ = _hand_bytes(c, experts_on_device=384)
    (kind,) = plan.device_kinds
    assert kind.experts == 384 and kind.weights == device
    experts = device["experts_fp4"] + device["experts_fp4_scales"]
    assert not plan.fits and plan.kv_pool_tokens_total == 0
    assert plan.refusal() == (
        f"weights need {sum(device.values()) / GIB:.1f} GiB per device, 141.0 GiB available: "
        f"without --enable-expert-parallel every rank holds all 384 routed experts "
        f"({experts / GIB:.1f} GiB); add --enable-expert-parallel to split them over the 8 ranks"
    )
    assert plan.refusal().startswith("weights need 286.5 GiB per device")  # type: ignore[union-attr]


def test_a_tp_group_is_bounded_by_its_smallest_pool() -> None:
    """8 experts over 6 ranks: ranks 0-1 hold 2, ranks 2-5 one; TP2 groups (0,1) (2,3) (4,5)."""
    c = ModelConfig.tiny()
    plan = memory_plan(c, 6, 4 * GIB, topology=Topology(2, 3, True))
    kinds = {k.experts: k for k in plan.device_kinds}
    assert (kinds[2].devices, kinds[1].devices) == ([0, 1], [2, 3, 4, 5])
    assert kinds[2].kv_pool_tokens < kinds[1].kv_pool_tokens
    assert plan.kv_pool_tokens_total == kinds[2].kv_pool_tokens + 2 * kinds[1].kv_pool_tokens


@pytest.mark.parametrize(
    ("devices", "topology", "message"),
    [
        (8, Topology(16, 1, True), "--devices 8 but --tensor-parallel-size 16"),
        (16, Topology(16, 1, True), "does not divide o_groups (8)"),
        (12, Topology(4, 3, True, nnodes=2), "a TP group must stay within one node"),
        (9, Topology(1, 9, True, nnodes=2), "do not split evenly over --nnodes 2"),
    ],
)
def test_impossible_topologies_are_refused(devices: int, topology: Topology, message: str) -> None:
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        memory_plan(ModelConfig.official(), devices, 141 * GIB, topology=topology)


def test_the_vision_tower_is_placed_replicated_at_its_stored_bytes() -> None:
    from engine.planning.accounting import param_shapes

    config = ModelConfig.official()
    shapes = param_shapes(config)
    norms = ("norm1.weight", "norm2.weight", "norm.weight")
    fp32 = [n for n in shapes if n.startswith("vision.") and n.endswith(norms)]
    fp32 += ["image_start", "image_newline", "image_end"]
    bf16 = [n for n in shapes if n.startswith(("vision.", "aligner.")) and n not in fp32]
    numel = {n: math.prod(shapes[n]) for n in shapes}
    want = 4 * sum(numel[n] for n in fp32) + 2 * sum(numel[n] for n in bf16)
    for tp in (1, 4):
        assert weight_bytes(config, shapes, tp).replicated["vision"] == want
