"""Parity with transformers' DeepSeek-V4 for the attention parts V4.1 shares with V4.

Same weights into both, fp32. What V4 does differently (and so is bridged or
left out here): an unweighted per-head RMSNorm on q (V4.1 has none), a ratio-4
compressor with overlapping windows and a position bias, and an indexer with
its own compressor over the hidden states instead of ``wk(latent)``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from engine.model.deepseek_v41.attention import Attention
from engine.model.deepseek_v41.candidates import visible_entries
from engine.model.deepseek_v41.compressor import Compressor, entry_positions
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.grouped_linear import GroupedLinear
from engine.model.deepseek_v41.indexer import Indexer
from engine.model.deepseek_v41.norm import RMSNorm
from engine.model.deepseek_v41.rope import rope_inv_freq, rope_tail
from engine.model.deepseek_v41.sink_attention import sink_attention
from kernels.kv_formats import fake_quant_index_key

hf = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
hf_config = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

TINY = ModelConfig.tiny()


def _hf_config(compress_rate: int = 2):
    """transformers' V4 config with the tiny V4.1 shapes and the official RoPE settings.

    Layer 0 is sliding-window ("main" RoPE, theta 10000), layer 1 a
    heavily-compressed layer ("compress" RoPE: theta 160000 + YaRN); the HCA
    compressor is run at ratio ``compress_rate`` so it matches ours.
    """
    rs = TINY.rope_scaling
    cfg = hf_config.DeepseekV4Config(
        vocab_size=128,
        hidden_size=TINY.hidden_size,
        num_hidden_layers=2,
        num_attention_heads=TINY.num_attention_heads,
        head_dim=TINY.head_dim,
        q_lora_rank=TINY.q_lora_rank,
        o_groups=TINY.o_groups,
        o_lora_rank=TINY.o_lora_rank,
        index_n_heads=TINY.index_n_heads,
        index_head_dim=TINY.index_head_dim,
        rms_norm_eps=TINY.rms_norm_eps,
        rope_theta=TINY.rope_theta,
        compress_rope_theta=TINY.compress_rope_theta,
        max_position_embeddings=TINY.max_position_embeddings,
        rope_parameters=dict(
            rope_type="yarn",
            factor=rs.factor,
            beta_fast=rs.beta_fast,
            beta_slow=rs.beta_slow,
            original_max_position_embeddings=rs.original_max_position_embeddings,
        ),
        layer_types=["sliding_attention", "heavily_compressed_attention"],
        compress_rates={
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": compress_rate,
        },
        sliding_window=TINY.sliding_window,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    cfg._attn_implementation = "eager"
    assert cfg.qk_rope_head_dim == TINY.qk_rope_head_dim
    return cfg


def _randomize(module: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def _copy(dst: nn.Parameter, src: torch.Tensor) -> None:
    assert dst.shape == src.shape, (dst.shape, src.shape)
    with torch.no_grad():
        dst.copy_(src)


def _swa_bias(T: int, window: int) -> torch.Tensor:
    pos = torch.arange(T)
    diff = pos[:, None] - pos[None, :]
    allowed = (diff >= 0) & (diff < window)
    return allowed, torch.zeros(T, T).masked_fill(~allowed, float("-inf"))


# ------------------------------------------------------------------- RoPE
def test_rope_frequencies_match_transformers():
    rot = hf.DeepseekV4RotaryEmbedding(_hf_config())
    # transformers applies YaRN to compressed ("compress") layers only, with attention_factor 1.
    assert rot.compress_attention_scaling == 1.0 and rot.main_attention_scaling == 1.0
    torch.testing.assert_close(rope_inv_freq(TINY, 2), rot.compress_inv_freq, rtol=1e-6, atol=0)
    torch.testing.assert_close(rope_inv_freq(TINY, 4), rot.compress_inv_freq, rtol=1e-6, atol=0)
    torch.testing.assert_close(rope_inv_freq(TINY, 0), rot.main_inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("layer_type, layer_id", [("main", 0), ("compress", 2)])
def test_rope_rotation_matches_apply_rotary_pos_emb(layer_type, layer_id):
    rot = hf.DeepseekV4RotaryEmbedding(_hf_config())
    T, H = 6, 3
    x = torch.randn(T, H, 512, generator=torch.Generator().manual_seed(0))
    pos = torch.tensor([0, 1, 7, 40, 300, 2047])
    cos, sin = rot(x, pos[None], layer_type=layer_type)
    x_hf = x.transpose(0, 1)[None]  # [B, H, T, D]
    inv = rope_inv_freq(TINY, layer_id)
    want = hf.apply_rotary_pos_emb(x_hf, cos, sin)[0].transpose(0, 1)
    torch.testing.assert_close(rope_tail(x, pos, inv), want, rtol=1e-5, atol=1e-4)
    want_inv = hf.apply_rotary_pos_emb(x_hf, cos, -sin)[0].transpose(0, 1)
    torch.testing.assert_close(rope_tail(x, pos, inv, inverse=True), want_inv, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------- RMSNorm
def test_rmsnorm_matches_transformers():
    ours, theirs = RMSNorm(512, 1e-20), hf.DeepseekV4RMSNorm(512, eps=1e-20)
    _randomize(theirs, 1)
    _copy(ours.weight, theirs.weight)
    x = torch.randn(4, 7, 512, generator=torch.Generator().manual_seed(2)) * 5
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------- grouped wo_a
def test_grouped_output_projection_matches_transformers():
    G, per_in, R = 2, 4 * 512, 64
    ours = GroupedLinear(per_in, R, G)
    theirs = hf.DeepseekV4GroupedLinear(per_in, G * R, G)
    _randomize(theirs, 3)
    _copy(ours.weight, theirs.weight)
    x = torch.randn(5, G, per_in, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- sink softmax
def test_sink_softmax_matches_eager_attention_forward():
    T, S, H, d = 5, 9, 4, 32
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(T, H, d, generator=g), torch.randn(S, d, generator=g)
    allowed = torch.rand(T, S, generator=g) < 0.7
    allowed[:, 0] = True  # transformers' eager path has no all-masked rows
    module = nn.Module()
    module.num_key_value_groups = H
    module.sinks = nn.Parameter(torch.randn(H, generator=g))
    module.training = False
    bias = torch.zeros(T, S).masked_fill(~allowed, float("-inf"))[None, None]
    kv = k[None, None]
    out, _ = hf.eager_attention_forward(module, q.transpose(0, 1)[None], kv, kv, bias, d**-0.5)
    got = sink_attention(q, k, allowed, module.sinks.detach(), d**-0.5)
    torch.testing.assert_close(got, out[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- a whole SWA layer
@torch.no_grad()
def test_sliding_window_layer_matches_transformers_up_to_v4_q_norm():
    cfg = _hf_config()
    theirs = hf.DeepseekV4Attention(cfg, 0).eval()
    _randomize(theirs, 6)
    ours = Attention(TINY, 0)
    pairs = {
        "wq_a.weight": "q_a_proj.weight",
        "q_norm.weight": "q_a_norm.weight",
        "wq_b.weight": "q_b_proj.weight",
        "wkv.weight": "kv_proj.weight",
        "kv_norm.weight": "kv_norm.weight",
        "wo_a.weight": "o_a_proj.weight",
        "wo_b.weight": "o_b_proj.weight",
        "attn_sink": "sinks",
    }
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        _copy(p, theirs_params[pairs[name]])
    assert set(pairs.values()) == set(theirs_params)

    T = 20  # longer than the 16-token window
    x = torch.randn(T, TINY.hidden_size, generator=torch.Generator().manual_seed(7))
    pos = torch.arange(T)
    allowed, bias = _swa_bias(T, TINY.sliding_window)
    rot = hf.DeepseekV4RotaryEmbedding(cfg)
    emb = {t: rot(x, pos[None], layer_type=t) for t in ("main", "compress")}
    want, _ = theirs(x[None], emb, pos[None], bias[None, None])

    q, _ = ours.project_q(x, pos)
    # V4 only: unweighted RMSNorm per head; a rotation keeps the norm, so it commutes with RoPE.
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + TINY.rms_norm_eps)
    o = sink_attention(q, ours.project_kv(x, pos), allowed, ours.attn_sink, ours.softmax_scale)
    torch.testing.assert_close(ours.project_out(o, pos), want[0], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- compressor
@pytest.mark.parametrize("layer_id", [2, 4])  # tiny: ratio 2 and ratio 1
@torch.no_grad()
def test_compressor_matches_hca_compressor_without_position_bias(layer_id):
    ratio = TINY.compress_ratios[layer_id]
    theirs = hf.DeepseekV4HCACompressor(_hf_config(compress_rate=ratio))
    _randomize(theirs, 8)
    theirs.position_bias.zero_()  # V4.1 has no position bias
    ours = Compressor(TINY, layer_id)
    _copy(ours.wkv.weight, theirs.kv_proj.weight)
    _copy(ours.norm.weight, theirs.kv_norm.weight)
    if ours.wgate is not None:
        _copy(ours.wgate.weight, theirs.gate_proj.weight)
    T = 11
    x = torch.randn(T, TINY.hidden_size, generator=torch.Generator().manual_seed(9))
    pos = torch.arange(T)
    want, block_bias = theirs(x[None], None, pos[None], None, 1)
    latent = ours(x)
    n = latent.shape[0]
    roped = rope_tail(latent, entry_positions(n, ratio), rope_inv_freq(TINY, layer_id))
    torch.testing.assert_close(roped, want[0, 0], rtol=1e-5, atol=1e-5)
    # Causality of compressed entries: visible iff j < (pos + 1) // ratio.
    assert torch.equal(block_bias[0, 0] == 0, visible_entries(pos, n, ratio))


# ------------------------------------------------------------------- indexer
@torch.no_grad()
def test_indexer_query_and_scores_match_transformers():
    cfg = _hf_config()
    theirs = hf.DeepseekV4Indexer(cfg)
    _randomize(theirs, 10)
    ours = Indexer(TINY, 2)
    _copy(ours.wq_b.weight, theirs.q_b_proj.weight)
    _copy(ours.weights_proj.weight, theirs.scorer.weights_proj.weight)
    T, S = 6, 5
    g = torch.Generator().manual_seed(11)
    qr = torch.randn(T, TINY.q_lora_rank, generator=g)
    x = torch.randn(T, TINY.hidden_size, generator=g)
    k = torch.randn(S, TINY.index_head_dim, generator=g)
    pos = torch.tensor([1, 2, 5, 8, 13, 900])

    qi, w = ours.queries(qr, x, pos)
    cos, sin = theirs.rotary_emb(x, pos[None], layer_type="compress")
    q_hf = theirs.q_b_proj(qr).view(1, T, -1, TINY.index_head_dim).transpose(1, 2)
    q_hf = hf.apply_rotary_pos_emb(q_hf, cos, sin).transpose(1, 2)  # [1, T, h, d]
    # V4.1 MXFP4-rounds V4's query before scoring (its transformers port does the
    # same): our query is V4's on that grid, code for code but for fp32 ties.
    q_v41 = fake_quant_index_key(q_hf[0])
    assert float((qi == q_v41).float().mean()) > 0.99
    want = theirs.scorer(q_v41[None], k[None], x[None])[0]
    torch.testing.assert_close(ours.scores(qi, w, k), want, rtol=1e-5, atol=1e-4)
