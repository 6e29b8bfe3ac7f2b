"""Parity with transformers' DeepSeek-V4 modules for the parts V4.1 shares unchanged.

Shared: the sqrt-softplus noaux_tc router, the clamped SwiGLU experts and
shared expert, the (non-hash) sparse MoE block, RMSNorm, and the mHC
coefficients / collapse / mix of one sublayer. Not shared, so not compared:
hash-routed MoE layers and the learned ``hc_head`` (V4 only), V4's collapse
with each sublayer's own ``pre`` (V4.1 uses the previous sublayer's; see
docs/design/model-notes.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.mhc import hc_coefficients, hc_collapse, hc_mix
from engine.model.deepseek_v41.moe import Expert, MoE

tv4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers.models.deepseek_v4.configuration_deepseek_v4 import (  # noqa: E402
    DeepseekV4Config,
)

DIM, INTER, N_EXPERTS, TOPK = 32, 16, 8, 2


@pytest.fixture(scope="module")
def hf_config() -> DeepseekV4Config:
    config = DeepseekV4Config(
        vocab_size=128,
        hidden_size=DIM,
        moe_intermediate_size=INTER,
        num_hidden_layers=2,
        n_routed_experts=N_EXPERTS,
        num_experts_per_tok=TOPK,
        mlp_layer_types=["moe", "moe"],  # no hash-routed layers in V4.1
        layer_types=["sliding_attention"] * 2,
        rms_norm_eps=1e-20,
        num_attention_heads=2,
        head_dim=16,
        q_lora_rank=16,
        o_groups=1,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        sliding_window=8,
    )
    config._experts_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def our_config() -> ModelConfig:
    return ModelConfig.tiny().replace(
        hidden_size=DIM,
        moe_intermediate_size=INTER,
        n_routed_experts=N_EXPERTS,
        num_experts_per_tok=TOPK,
    )


def _random_moe(config: ModelConfig, seed: int) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)  # large enough that both SwiGLU clamps engage
    return moe


def _copy_into_hf_block(moe: MoE, block: nn.Module) -> None:
    """Our stacked w1/w2/w3 [E, out, in] -> transformers' [gate; up] and down tensors."""
    with torch.no_grad():
        block.gate.weight.copy_(moe.gate.weight)
        block.gate.e_score_correction_bias.copy_(moe.gate.bias)
        block.experts.gate_up_proj.copy_(torch.cat([moe.experts.w1, moe.experts.w3], dim=1))
        block.experts.down_proj.copy_(moe.experts.w2)
        _copy_into_hf_mlp(moe.shared_experts, block.shared_experts)


def _copy_into_hf_mlp(expert: Expert, mlp: nn.Module) -> None:
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(expert.w1.weight)
        mlp.up_proj.weight.copy_(expert.w3.weight)
        mlp.down_proj.weight.copy_(expert.w2.weight)


def _input(seed: int, T: int = 24) -> torch.Tensor:
    return torch.randn(T, DIM, generator=torch.Generator().manual_seed(seed)) * 3


def test_router_matches(hf_config, our_config):
    moe = _random_moe(our_config, 0)
    with torch.no_grad():
        moe.gate.bias.copy_(torch.linspace(-0.5, 0.5, N_EXPERTS))
    router = tv4.DeepseekV4TopKRouter(hf_config)
    with torch.no_grad():
        router.weight.copy_(moe.gate.weight)
        router.e_score_correction_bias.copy_(moe.gate.bias)
    x = _input(1)
    weights, idx = moe.gate(x)
    _, hf_weights, hf_idx = router(x)
    # transformers returns its top-k unsorted: compare in expert-id order.
    ours, hf = idx.sort(-1), hf_idx.sort(-1)
    assert torch.equal(ours.values, hf.values)
    torch.testing.assert_close(
        weights.gather(-1, ours.indices), hf_weights.gather(-1, hf.indices), atol=1e-6, rtol=1e-6
    )


def test_shared_expert_matches_mlp(hf_config, our_config):
    moe = _random_moe(our_config, 2)
    mlp = tv4.DeepseekV4MLP(hf_config)
    _copy_into_hf_mlp(moe.shared_experts, mlp)
    x = _input(3)
    with torch.no_grad():
        torch.testing.assert_close(moe.shared_experts(x), mlp(x), atol=1e-5, rtol=1e-5)
        clamped = (moe.shared_experts.w1(x) > 10).any() and (moe.shared_experts.w3(x) < -10).any()
    assert clamped


def test_routed_experts_match(hf_config, our_config):
    moe = _random_moe(our_config, 4)
    block = tv4.DeepseekV4SparseMoeBlock(hf_config, 0)
    _copy_into_hf_block(moe, block)
    x = _input(5)
    with torch.no_grad():
        weights, idx = moe.gate(x)
        routed = moe(x) - moe.shared_experts(x)
        hf_routed = block.experts(x, idx, weights)
    torch.testing.assert_close(routed, hf_routed, atol=1e-4, rtol=1e-5)


def test_sparse_moe_block_matches(hf_config, our_config):
    moe = _random_moe(our_config, 6)
    block = tv4.DeepseekV4SparseMoeBlock(hf_config, 1)
    assert not block.is_hash
    _copy_into_hf_block(moe, block)
    x = _input(7)
    with torch.no_grad():
        ours = moe(x)
        hf = block(x.unsqueeze(0)).squeeze(0)
    torch.testing.assert_close(ours, hf, atol=1e-4, rtol=1e-5)


def test_rmsnorm_matches():
    norm_mod = pytest.importorskip("engine.model.deepseek_v41.norm")
    ours = norm_mod.RMSNorm(DIM, 1e-20)
    hf = tv4.DeepseekV4RMSNorm(DIM, eps=1e-20)
    with torch.no_grad():
        w = torch.randn(DIM)
        ours.weight.copy_(w)
        hf.weight.copy_(w)
    x = _input(8)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=1e-6)


def _hc_params(hc_module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        hc_module.fn.copy_(torch.randn(hc_module.fn.shape, generator=g) * 0.5)
        hc_module.base.copy_(torch.randn(hc_module.base.shape, generator=g))
        hc_module.scale.copy_(torch.rand(3, generator=g) + 0.5)


def _coefficients(hc_module: nn.Module, R: torch.Tensor, config: DeepseekV4Config):
    return hc_coefficients(
        R,
        hc_module.fn,
        hc_module.base,
        hc_module.scale,
        hc_eps=config.hc_eps,
        sinkhorn_iters=config.hc_sinkhorn_iters,
        norm_eps=config.rms_norm_eps,
    )


def test_hyper_connection_coefficients_match(hf_config):
    hc_module = tv4.DeepseekV4HyperConnection(hf_config)
    _hc_params(hc_module, 9)
    R = torch.randn(1, 6, hf_config.hc_mult, DIM)
    with torch.no_grad():
        hf_post, hf_comb, hf_collapsed = hc_module(R)
        pre, post, comb = _coefficients(hc_module, R[0], hf_config)
    torch.testing.assert_close(post, hf_post[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(comb, hf_comb[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hc_collapse(R[0], pre), hf_collapsed[0], atol=1e-6, rtol=1e-6)


class _Linear(nn.Module):
    """Stands in for a sublayer: a fixed linear map, returning what the layer expects."""

    def __init__(self, weight: torch.Tensor, returns_tuple: bool) -> None:
        super().__init__()
        self.weight = weight
        self.returns_tuple = returns_tuple

    def forward(self, x: torch.Tensor, **_: object):
        y = x @ self.weight.T
        return (y, None) if self.returns_tuple else y


def test_hyper_connection_mix_matches_decoder_layer(hf_config):
    """A V4 layer with stub sublayers: collapse with own pre, sublayer, mix; twice."""
    layer = tv4.DeepseekV4DecoderLayer(hf_config, 0)
    _hc_params(layer.attn_hc, 10)
    _hc_params(layer.ffn_hc, 11)
    g = torch.Generator().manual_seed(12)
    wa, wf = torch.randn(DIM, DIM, generator=g), torch.randn(DIM, DIM, generator=g)
    layer.self_attn = _Linear(wa, returns_tuple=True)
    layer.mlp = _Linear(wf, returns_tuple=False)
    R = torch.randn(1, 5, hf_config.hc_mult, DIM, generator=g)
    with torch.no_grad():
        hf_out = layer(R)[0]
        S = R[0]
        for hc_module, norm, w in (
            (layer.attn_hc, layer.input_layernorm, wa),
            (layer.ffn_hc, layer.post_attention_layernorm, wf),
        ):
            pre, post, comb = _coefficients(hc_module, S, hf_config)
            y = norm(hc_collapse(S, pre)) @ w.T
            S = hc_mix(S, y, post, comb)
    torch.testing.assert_close(S, hf_out, atol=1e-5, rtol=1e-5)
