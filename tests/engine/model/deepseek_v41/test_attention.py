from __future__ import annotations

import math

import torch

from engine.model.deepseek_v41.attention import Attention
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.sink_attention import sink_attention


def _rope64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, sign: float = 1.0):
    """Float64 complex-multiplication RoPE on the last 2*len(inv_freq) dims."""
    r = 2 * inv_freq.shape[0]
    x64 = x.double()
    z = torch.complex(x64[..., -r::2], x64[..., -r + 1 :: 2])
    angle = pos.double()[:, None] * inv_freq.double()[None, :] * sign
    z = z * torch.polar(torch.ones_like(angle), angle).view(
        (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    )
    return torch.cat((x64[..., :-r], torch.stack((z.real, z.imag), -1).flatten(-2)), -1)


def _rms64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * w.double()


def _random_attention(config: ModelConfig, layer_id: int, seed: int) -> Attention:
    attn = Attention(config, layer_id)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return attn


# ---------------------------------------------------------------- sink attention
def test_sink_attention_matches_float64_loop():
    g = torch.Generator().manual_seed(0)
    T, H, S, d = 5, 3, 7, 16
    q, k = torch.randn(T, H, d, generator=g), torch.randn(S, d, generator=g)
    sink = torch.tensor([-1.0, 0.0, 2.5])
    mask = torch.rand(T, S, generator=g) < 0.6
    mask[2] = False  # a query with nothing visible: only the sink
    scale = d**-0.5
    got = sink_attention(q, k, mask, sink, scale)
    want = torch.zeros(T, H, d, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            keys = [s for s in range(S) if mask[t, s]]
            logits = [float(q[t, h].double() @ k[s].double()) * scale for s in keys]
            denom = sum(math.exp(v) for v in logits) + math.exp(float(sink[h]))
            for s, v in zip(keys, logits, strict=True):
                want[t, h] += math.exp(v) / denom * k[s].double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[2], torch.zeros(H, d))


def test_sink_attention_sink_takes_weight_and_keeps_dtype():
    # One visible key, logit 0, sink 0: the key gets exactly half the weight.
    k = torch.ones(1, 4)
    q = torch.zeros(1, 1, 4)
    out = sink_attention(q, k, torch.ones(1, 1, dtype=torch.bool), torch.zeros(1), 1.0)
    torch.testing.assert_close(out, torch.full((1, 1, 4), 0.5))
    out16 = sink_attention(
        q.bfloat16(), k.bfloat16(), torch.ones(1, 1, dtype=torch.bool), torch.zeros(1), 1.0
    )
    assert out16.dtype == torch.bfloat16


# ---------------------------------------------------------------- parameters
def _shapes(attn: Attention) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in attn.named_parameters()}


def test_official_parameter_names_and_shapes():
    config = ModelConfig.official()
    with torch.device("meta"):
        full2, full20 = Attention(config, 2), Attention(config, 20)
        reindex, reuse, swa = Attention(config, 24), Attention(config, 21), Attention(config, 0)
    common = {
        "wq_a.weight": (1280, 5120),
        "q_norm.weight": (1280,),
        "wq_b.weight": (64 * 512, 1280),
        "wkv.weight": (512, 5120),
        "kv_norm.weight": (512,),
        "wo_a.weight": (8 * 1024, 8 * 512),
        "wo_b.weight": (5120, 8 * 1024),
        "attn_sink": (64,),
    }
    query = {"indexer.wq_b.weight": (32 * 128, 1280), "indexer.weights_proj.weight": (32, 5120)}
    keys = {"indexer.wk.weight": (128, 512), "indexer.k_norm.weight": (128,)}
    comp = {"compressor.wkv.weight": (512, 5120), "compressor.norm.weight": (512,)}
    assert _shapes(swa) == common
    assert _shapes(reuse) == common
    assert _shapes(reindex) == {**common, **query}
    assert _shapes(full20) == {**common, **query, **keys, **comp}
    assert _shapes(full2) == {
        **common,
        **query,
        **keys,
        **comp,
        "compressor.wgate.weight": (512, 5120),
    }
    assert full2.attn_sink.dtype == torch.float32
    # RoPE tables are derived, not checkpoint tensors.
    assert "inv_freq" not in full20.state_dict()
    assert "indexer.inv_freq" not in full20.state_dict()


# ---------------------------------------------------------------- projections
def test_projections_match_float64_oracle():
    config = ModelConfig.tiny()
    attn = _random_attention(config, 2, seed=1)
    g = torch.Generator().manual_seed(2)
    T = 6
    x = torch.randn(T, config.hidden_size, generator=g)
    pos = torch.tensor([0, 1, 2, 9, 33, 500])
    eps = config.rms_norm_eps
    x64 = x.double()

    q, qr = attn.project_q(x, pos)
    qr64 = _rms64(x64 @ attn.wq_a.weight.double().T, attn.q_norm.weight, eps)
    q64 = (qr64 @ attn.wq_b.weight.double().T).view(T, config.num_attention_heads, 512)
    q64 = _rope64(q64, pos, attn.inv_freq)
    torch.testing.assert_close(qr.double(), qr64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q.double(), q64, rtol=1e-4, atol=1e-4)

    kv = attn.project_kv(x, pos)
    kv64 = _rope64(
        _rms64(x64 @ attn.wkv.weight.double().T, attn.kv_norm.weight, eps), pos, attn.inv_freq
    )
    torch.testing.assert_close(kv.double(), kv64, rtol=1e-5, atol=1e-5)


def test_project_out_inverse_rope_then_grouped_wo_a():
    config = ModelConfig.tiny()  # 8 heads in 2 groups, o_lora_rank 64
    attn = _random_attention(config, 0, seed=3)
    g = torch.Generator().manual_seed(4)
    T, H, G, R = 4, 8, 2, 64
    o = torch.randn(T, H, 512, generator=g)
    pos = torch.tensor([0, 3, 17, 128])
    got = attn.project_out(o, pos)
    o64 = _rope64(o, pos, attn.inv_freq, sign=-1.0)
    wo_a, wo_b = attn.wo_a.weight.double(), attn.wo_b.weight.double()
    want = torch.zeros(T, config.hidden_size, dtype=torch.float64)
    for t in range(T):
        for grp in range(G):
            heads = o64[t, grp * H // G : (grp + 1) * H // G].reshape(-1)  # concatenated heads
            z = wo_a[grp * R : (grp + 1) * R] @ heads
            want[t] += wo_b[:, grp * R : (grp + 1) * R] @ z
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_qk_products_depend_only_on_relative_position():
    # K = V with RoPE on both sides: q(p) . k(p') is a function of p - p'.
    config = ModelConfig.tiny()
    attn = _random_attention(config, 4, seed=5)
    x = torch.randn(2, config.hidden_size, generator=torch.Generator().manual_seed(6))
    q_a, _ = attn.project_q(x[:1], torch.tensor([10]))
    k_a = attn.project_kv(x[1:], torch.tensor([3]))
    q_b, _ = attn.project_q(x[:1], torch.tensor([1010]))
    k_b = attn.project_kv(x[1:], torch.tensor([1003]))
    torch.testing.assert_close(q_a[0] @ k_a[0], q_b[0] @ k_b[0], rtol=1e-4, atol=1e-3)
    k_c = attn.project_kv(x[1:], torch.tensor([1004]))
    assert not torch.allclose(q_b[0] @ k_b[0], q_b[0] @ k_c[0], rtol=1e-4, atol=1e-3)


def test_bfloat16_inputs_keep_dtype():
    config = ModelConfig.tiny()
    attn = _random_attention(config, 2, seed=7)
    x = torch.randn(3, config.hidden_size).bfloat16()
    pos = torch.arange(3)
    q, qr = attn.project_q(x, pos)
    assert q.dtype == qr.dtype == attn.project_kv(x, pos).dtype == torch.bfloat16
    assert attn.project_out(q, pos).dtype == torch.bfloat16
