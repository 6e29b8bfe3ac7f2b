"""MoE router and experts against hand-computed values and a float64 dense oracle."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.moe import Expert, Gate, MoE
from kernels.weight_formats import dequantize_mxfp4_weight


def _silu(v: float) -> float:
    return v / (1 + math.exp(-v))


def _sqrt_softplus(v: float) -> float:
    return math.sqrt(math.log1p(math.exp(v)))


def test_expert_clamps_gate_from_above_only_and_up_on_both_sides():
    ex = Expert(dim=2, inter_dim=1, swiglu_limit=10.0)
    with torch.no_grad():
        ex.w1.weight.copy_(torch.tensor([[-15.0, 12.0]]))  # gate per unit input
        ex.w3.weight.copy_(torch.tensor([[12.0, -11.0]]))  # up per unit input
        ex.w2.weight.copy_(torch.tensor([[2.0], [-3.0]]))
    out = ex(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    # token 0: gate -15 stays (no lower clamp), up 12 -> 10
    h0 = _silu(-15.0) * 10.0
    # token 1: gate 12 -> 10, up -11 -> -10
    h1 = _silu(10.0) * -10.0
    want = torch.tensor([[2 * h0, -3 * h0], [2 * h1, -3 * h1]])
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_expert_weights_scale_the_output():
    torch.manual_seed(0)
    ex = Expert(dim=8, inter_dim=4, swiglu_limit=10.0)
    x = torch.randn(3, 8)
    w = torch.tensor([[0.5], [2.0], [0.0]])
    torch.testing.assert_close(ex(x, w), ex(x) * w, atol=1e-6, rtol=1e-6)


def _gate_config(n_experts: int, k: int, dim: int) -> ModelConfig:
    return ModelConfig.tiny().replace(
        hidden_size=dim, n_routed_experts=n_experts, num_experts_per_tok=k
    )


def test_gate_bias_selects_but_scores_weight_hand_computed():
    gate = Gate(_gate_config(4, 2, 1))
    logits = [2.0, 1.0, 0.0, -1.0]
    with torch.no_grad():
        gate.weight.copy_(torch.tensor(logits).view(4, 1))
        gate.bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    weights, idx = gate(torch.ones(1, 1))
    assert weights.dtype == torch.float32
    # Expert 2 wins on its bias, expert 0 on its score; expert 1 is left out.
    order = idx[0].tolist()
    assert sorted(order) == [0, 2]
    s = [_sqrt_softplus(v) for v in logits]
    want = {e: s[e] / (s[0] + s[2]) * 1.5 for e in (0, 2)}
    for slot, e in enumerate(order):
        assert weights[0, slot].item() == pytest.approx(want[e], rel=1e-6)


def _oracle_moe(moe: MoE, x: torch.Tensor, limit: float) -> torch.Tensor:
    """Dense float64: every token scores every expert, keeps its top-k, sums."""

    def expert(w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, v: torch.Tensor):
        gate = (w1.double() @ v).clamp(max=limit)
        up = (w3.double() @ v).clamp(-limit, limit)
        return w2.double() @ (gate * torch.sigmoid(gate) * up)

    routed, shared = moe.experts, moe.shared_experts

    k = moe.gate.topk
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        v = x[t].double()
        s = torch.sqrt(torch.log1p(torch.exp(moe.gate.weight.double() @ v)))
        chosen = sorted(range(len(s)), key=lambda e: -(s[e] + moe.gate.bias[e].double()).item())[:k]
        total = sum(s[e] for e in chosen)
        for e in chosen:
            out[t] += s[e] / total * 1.5 * expert(routed.w1[e], routed.w2[e], routed.w3[e], v)
        out[t] += expert(shared.w1.weight, shared.w2.weight, shared.w3.weight, v)
    return out


def test_moe_matches_dense_float64_oracle():
    config = ModelConfig.tiny()
    torch.manual_seed(0)
    moe = MoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.15)  # large enough that the SwiGLU clamp engages
    x = torch.randn(12, config.hidden_size) * 4
    got = moe(x)
    want = _oracle_moe(moe, x, config.swiglu_limit)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    # Both clamps really were exercised by this input.
    gate = torch.einsum("eid,td->eti", moe.experts.w1, x)
    up = torch.einsum("eid,td->eti", moe.experts.w3, x)
    assert (gate > config.swiglu_limit).any() and (up < -config.swiglu_limit).any()


def test_moe_keeps_bf16_input_dtype():
    config = ModelConfig.tiny()
    torch.manual_seed(1)
    moe = MoE(config).to(torch.bfloat16)
    x = torch.randn(4, config.hidden_size).to(torch.bfloat16)
    assert moe(x).dtype == torch.bfloat16


def test_checkpoint_names():
    config = ModelConfig.tiny()
    names = set(MoE(config).state_dict())
    assert {"gate.weight", "gate.bias", "experts.0.w1.weight", "experts.7.w3.weight"} <= names
    # The experts are stored stacked, but no stacked name reaches the checkpoint.
    assert not {"experts.w1", "experts.w2", "experts.w3"} & names
    assert {"shared_experts.w1.weight", "shared_experts.w2.weight"} <= names
    assert MoE(config).shared_experts.w1.weight.shape == (
        config.moe_intermediate_size * config.n_shared_experts,
        config.hidden_size,
    )


# ------------------------------------------------------------- fused vs the per-expert loop


def _float64_moe(seed: int) -> MoE:
    config = ModelConfig.tiny()
    torch.manual_seed(seed)
    moe = MoE(config).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.15)
        # Column 0 of the router is 1 for every expert: a row with a large
        # negative x[0] scores every expert at softplus(-1000) = 0 in float64.
        moe.gate.weight[:, 0] = 1.0
        # Expert 7's selection bias keeps it out of every top-k: it gets no row.
        moe.gate.bias[7] = -1e6
    return moe


def test_fused_moe_equals_the_per_expert_loop_float64():
    """The stacked, grouped experts against the old layout (``LoopMoE``: one module per
    expert, a ``torch.where`` per expert), float64, on the same exact routing.

    "A row routed to the shared expert only": V4.1's router always picks k
    experts, so such a row is one whose routed weights are all zero. Row 3 is
    made so: every expert's score underflows (softplus(-1000) = 0 in float64),
    its top-k weights are exactly 0, its routed experts still run and add
    exactly nothing, and its output is the shared expert's alone. Expert 7
    receives no row (its selection bias is -1e6).
    """
    from bench.moe_bench import LoopMoE

    moe = _float64_moe(0)
    x = torch.randn(12, moe.gate.weight.shape[1], dtype=torch.float64) * 4
    x[:, 0] = x[:, 0].clamp(-1.0, 1.0)
    x[3, 0] = -1000.0
    weights, idx = moe.gate(x)
    assert torch.equal(weights[3], torch.zeros_like(weights[3]))
    assert not (idx == 7).any()
    assert len(idx.unique()) >= 5  # several experts share the step's rows

    got = moe(x)
    want = LoopMoE(moe)(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    shared = moe.shared_experts(x)[3]
    assert torch.equal(moe.experts(x, weights, idx)[3], torch.zeros_like(shared))
    torch.testing.assert_close(got[3], shared, atol=0, rtol=0)


def test_fused_moe_gradients_equal_the_per_expert_loop():
    """Training runs the unpacked experts: their gradients per expert equal the old modules'."""
    from bench.moe_bench import LoopMoE

    moe = _float64_moe(1)
    loop = LoopMoE(moe)
    x = torch.randn(10, moe.gate.weight.shape[1], dtype=torch.float64)
    probe = torch.randn(10, x.shape[1], dtype=torch.float64)
    (moe(x) * probe).sum().backward()
    (loop(x) * probe).sum().backward()
    for e, expert in enumerate(loop.experts):
        for name in ("w1", "w2", "w3"):
            want = getattr(expert, name).weight.grad
            got = getattr(moe.experts, name).grad[e]
            if want is None:  # an expert without rows
                assert e == 7 and torch.equal(got, torch.zeros_like(got))
            else:
                torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert moe.experts.w1.grad[:7].abs().sum(dim=(1, 2)).min() > 0


def test_packed_moe_matches_the_unpacked_one_on_its_served_weights():
    """Packed experts (MXFP4 bytes, E4M3 activations) against the unpacked experts holding
    the same dequantised weights: the only difference left is the activation
    quantisation, E4M3 with 3 mantissa bits (relative error <= 2^-4 per element)."""
    config = ModelConfig.tiny()
    torch.manual_seed(2)
    moe = MoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.1)
    packed = moe.experts.packed_copy()
    served = MoE(config)
    served.load_state_dict(moe.state_dict())
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            q = getattr(packed, name)
            s = getattr(packed, name + "_scale")
            getattr(served.experts, name).copy_(dequantize_mxfp4_weight(q, s, torch.float32))
    x = torch.randn(9, config.hidden_size)
    with torch.no_grad():
        weights, idx = moe.gate(x)
        got = packed(x, weights, idx)
        want = served.experts(x, weights, idx)
    err = (got - want).norm() / want.norm()
    assert 1e-4 < err < 2**-4, err  # real quantisation, within E4M3's step


def test_packed_experts_quantising_tokens_before_the_gather_give_the_same_bits():
    """The CPU path quantises each token once and gathers its rows (sharing the result
    with the shared expert): bitwise the step that gathers the rows and quantises
    each (token, slot) row, as the Triton path does."""
    from engine.model.deepseek_v41.routed_experts import clamped_swiglu, group_by_expert
    from kernels.act_quant import quantize_act_fp8
    from kernels.moe_ops import grouped_mxfp4_matmul_reference

    config = ModelConfig.tiny()
    torch.manual_seed(3)
    moe = MoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.1)
    packed = moe.experts.packed_copy()
    x = torch.randn(7, config.hidden_size)
    with torch.no_grad():
        weights, idx = moe.gate(x)
        got = packed(x, weights, idx)
        routing = group_by_expert(weights, idx, packed.n_experts)
        off = routing.offsets
        a = quantize_act_fp8(x[routing.token])
        gate = grouped_mxfp4_matmul_reference(*a, off, packed.w1, packed.w1_scale)
        up = grouped_mxfp4_matmul_reference(*a, off, packed.w3, packed.w3_scale)
        h = routing.weight * clamped_swiglu(gate, up, packed.swiglu_limit)
        out = grouped_mxfp4_matmul_reference(*quantize_act_fp8(h), off, packed.w2, packed.w2_scale)
        want = torch.zeros_like(x).index_add_(0, routing.token, out)
    assert torch.equal(got, want)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_expert_shards_sum_to_the_whole_layer(packed):
    """EP's local filter: the shards [0, 3), [3, 8) of 8 experts, each computing only
    the pairs routed to its experts, add up to the whole module's output; a shard's
    state dict names its experts by their global ids."""
    from engine.model.deepseek_v41.routed_experts import RoutedExperts

    torch.manual_seed(0)
    whole = RoutedExperts(8, 64, 32, 7.0).double()
    if packed:
        whole = whole.packed_copy()
    state = whole.state_dict()
    shards = []
    for first, stop in ((0, 3), (3, 8)):
        shard = RoutedExperts(stop - first, 64, 32, 7.0, first=first, total=8).double()
        if packed:
            shard = shard.packed_copy()
        names = {k for k in state if first <= int(k.split(".")[0]) < stop}
        assert set(shard.state_dict()) == names
        shard.load_state_dict({k: state[k] for k in names})
        shards.append(shard)
    x = torch.randn(11, 64, dtype=torch.float64)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(11)])
    weights = torch.rand(11, 2, dtype=torch.float64)
    want = whole(x, weights, idx)
    got = shards[0](x, weights, idx) + shards[1](x, weights, idx)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="experts"):
        RoutedExperts(4, 64, 32, 7.0, first=6, total=8)
