from __future__ import annotations

import math

import pytest
import torch

from engine.model.deepseek_v41.compressor import entry_positions
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.indexer import Indexer, indexer_scores
from engine.model.deepseek_v41.rope import rope_inv_freq


def _rope64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Float64 complex-multiplication RoPE on the last 2*len(inv_freq) dims."""
    r = 2 * inv_freq.shape[0]
    x64 = x.double()
    z = torch.complex(x64[..., -r::2], x64[..., -r + 1 :: 2])
    angle = pos.double()[:, None] * inv_freq.double()[None, :]
    z = z * torch.polar(torch.ones_like(angle), angle).view(
        (x.shape[0],) + (1,) * (x.dim() - 2) + (-1,)
    )
    return torch.cat((x64[..., :-r], torch.stack((z.real, z.imag), -1).flatten(-2)), -1)


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _mxfp4_grid64(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., 128] on the MXFP4 grid: per block of 32 a power-of-two scale
    ``2^ceil(log2(amax / 6))``, values rounded to the nearest E2M1 magnitude (ties
    to the even code), in float64."""
    blocks = x.double().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6)))
    mag = (blocks.abs() / scale).clamp(max=6.0)
    d = (mag[..., None] - _E2M1).abs()
    tied = d == d.amin(-1, keepdim=True)
    even = tied & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.int().argmax(-1), tied.int().argmax(-1))
    return (torch.sign(blocks) * _E2M1[code] * scale).flatten(-2)


def _random_indexer(layer_id: int, seed: int) -> Indexer:
    idx = Indexer(ModelConfig.tiny(), layer_id)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in idx.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return idx


def test_indexer_scores_match_float64_loop():
    g = torch.Generator().manual_seed(0)
    T, h, S, d = 4, 3, 6, 8
    qi, w, k = (
        torch.randn(T, h, d, generator=g),
        torch.randn(T, h, generator=g),
        torch.randn(S, d, generator=g),
    )
    got = indexer_scores(qi, w, k)
    want = torch.zeros(T, S, dtype=torch.float64)
    for t in range(T):
        for s in range(S):
            for j in range(h):
                dot = float(qi[t, j].double() @ k[s].double())
                want[t, s] += float(w[t, j]) * max(dot, 0.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # The method is the same function, with each head's relu scaled by head_dim^-0.5.
    idx = Indexer(ModelConfig.tiny(), 2)
    assert idx.score_scale == 128**-0.5
    assert torch.equal(idx.scores(qi, w, k), indexer_scores(qi, w, k, 128**-0.5))
    torch.testing.assert_close(idx.scores(qi, w, k), got * 128**-0.5, rtol=1e-6, atol=1e-7)


def test_queries_rope_tail_and_head_weights():
    config = ModelConfig.tiny()
    idx = _random_indexer(6, seed=1)  # a reindex layer: query side only
    assert idx.wk is None and idx.k_norm is None
    g = torch.Generator().manual_seed(2)
    T = 5
    qr, x = torch.randn(T, config.q_lora_rank, generator=g), torch.randn(T, 256, generator=g)
    pos = torch.tensor([0, 4, 9, 63, 700])
    qi, w = idx.queries(qr, x, pos)
    qi64 = (qr.double() @ idx.wq_b.weight.double().T).view(T, 4, 128)
    # The query is MXFP4-rounded like the keys (the release's scoring): compare with
    # the float64 RoPE'd query put on that grid by hand, block by block of 32.
    expected = _mxfp4_grid64(_rope64(qi64, pos, rope_inv_freq(config, 6)))
    exact = (qi.double() == expected).double().mean()
    assert exact > 0.99, f"only {float(exact):.3f} of the codes match"
    step = expected.abs().view(T, 4, 4, 32).amax(-1, keepdim=True) / 6 * 2  # one code step
    assert bool(((qi.double() - expected).abs().view(T, 4, 4, 32) <= step).all())
    w64 = x.double() @ idx.weights_proj.weight.double().T * 4**-0.5  # n_heads^-0.5
    torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=1e-6)
    # Indexer RoPE uses the ratio>0 (YaRN) frequencies, not the plain ones.
    torch.testing.assert_close(idx.inv_freq, rope_inv_freq(config, 2))
    assert not torch.allclose(idx.inv_freq, rope_inv_freq(config, 0))


def test_keys_are_normed_projections_roped_at_group_start():
    config = ModelConfig.tiny()
    idx = _random_indexer(2, seed=3)  # ratio-2 kv source
    latent = torch.randn(4, 512, generator=torch.Generator().manual_seed(4))
    starts = entry_positions(4, 2, start_entry=3)  # entries 3..6 start at 6, 8, 10, 12
    got = idx.keys(latent, starts)
    k64 = latent.double() @ idx.wk.weight.double().T
    k64 = k64 / torch.sqrt((k64**2).mean(-1, keepdim=True) + config.rms_norm_eps)
    k64 = k64 * idx.k_norm.weight.double()
    want = _rope64(k64, torch.tensor([6, 8, 10, 12]), idx.inv_freq)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # Dims 0..63 carry no RoPE; 64..127 do. Roping at the group's last token would differ.
    torch.testing.assert_close(got[:, :64].double(), k64[:, :64], rtol=1e-5, atol=1e-5)
    wrong = _rope64(k64, torch.tensor([7, 9, 11, 13]), idx.inv_freq)
    assert not torch.allclose(got.double(), wrong, atol=1e-3)


def test_only_index_sources_build_an_indexer():
    with pytest.raises(ValueError):
        Indexer(ModelConfig.tiny(), 3)  # a reuse layer


def test_quantised_query_flips_a_pick_as_the_release_scores():
    """Hand-built: head 0's query has 0.74 at dim 1 (block 0, whose amax 6 gives scale 1:
    MXFP4 rounds it to 0.5) and 0.70 at dim 40 (alone in block 1: scale 1/8, 5.6 -> 6,
    so 0.75). Unquantised, key e1 (score 0.74) beats key e40 (0.70); quantised as the
    release scores, e40 (0.75) beats e1 (0.5)."""
    from engine.model.deepseek_v41.candidates import select_topk

    idx = Indexer(ModelConfig.tiny(), 2)
    q = torch.zeros(idx.n_heads * idx.head_dim)
    q[0], q[1], q[40] = 6.0, 0.74, 0.70
    with torch.no_grad():
        idx.wq_b.weight.zero_()
        idx.wq_b.weight[:, 0] = q  # qr = e0 selects this column: head 0 gets q[:128]
        idx.weights_proj.weight.zero_()
        idx.weights_proj.weight[0, 0] = 1.0  # only head 0 weighs in
    qr = torch.zeros(1, idx.wq_b.weight.shape[1])
    qr[0, 0] = 1.0
    x = torch.zeros(1, idx.weights_proj.weight.shape[1])
    x[0, 0] = 1.0
    keys = torch.zeros(2, idx.head_dim)
    keys[0, 1] = keys[1, 40] = 1.0
    qi, w = idx.queries(qr, x, torch.tensor([0]))  # position 0: RoPE is the identity
    assert qi[0, 0, 1] == 0.5 and qi[0, 0, 40] == 0.75
    visible = torch.ones(1, 2, dtype=torch.bool)
    assert select_topk(idx.scores(qi, w, keys), visible, 1).tolist() == [[1]]
    unquantised = q[: idx.head_dim].view(1, 1, -1).expand(1, idx.n_heads, -1)
    assert select_topk(idx.scores(unquantised, w, keys), visible, 1).tolist() == [[0]]
