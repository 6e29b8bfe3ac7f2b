"""MoE router and experts against hand-computed values and a float64 dense oracle."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.moe import Expert, Gate, MoE


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

    def expert(e: Expert, v: torch.Tensor) -> torch.Tensor:
        gate = (e.w1.weight.double() @ v).clamp(max=limit)
        up = (e.w3.weight.double() @ v).clamp(-limit, limit)
        return e.w2.weight.double() @ (gate * torch.sigmoid(gate) * up)

    k = moe.gate.topk
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        v = x[t].double()
        s = torch.sqrt(torch.log1p(torch.exp(moe.gate.weight.double() @ v)))
        chosen = sorted(range(len(s)), key=lambda e: -(s[e] + moe.gate.bias[e].double()).item())[:k]
        total = sum(s[e] for e in chosen)
        for e in chosen:
            out[t] += s[e] / total * 1.5 * expert(moe.experts[e], v)
        out[t] += expert(moe.shared_experts, v)
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
    gate = torch.stack([e.w1(x) for e in moe.experts])
    up = torch.stack([e.w3(x) for e in moe.experts])
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
    assert {"shared_experts.w1.weight", "shared_experts.w2.weight"} <= names
    assert MoE(config).shared_experts.w1.weight.shape == (
        config.moe_intermediate_size * config.n_shared_experts,
        config.hidden_size,
    )
