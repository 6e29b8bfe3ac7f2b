"""The ViT, the aligner and the span against a float64 reference written here
from the description (per-patch loops, explicit attention), not from the code."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.vision.aligner import Aligner, merge_cells
from engine.model.deepseek_v41.vision.config import VisionConfig, with_vision
from engine.model.deepseek_v41.vision.image_plan import ImagePlan
from engine.model.deepseek_v41.vision.span import span_roles, span_rows
from engine.model.deepseek_v41.vision.vit import VisionTransformer

SMALL = VisionConfig(
    num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=24
)


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return module.double()


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean() + 1e-6)


def _rotary_one(v: torch.Tensor, row: int, col: int, theta: float) -> torch.Tensor:
    """One head vector: pair (i, i + d/2) turns by row * f_i for the first d/4 pairs,
    by col * f_(i - d/4) for the rest, f_j = theta^(-4j / d)."""
    d = v.shape[0]
    half, quarter = d // 2, d // 4
    out = v.clone()
    for i in range(half):
        j = i if i < quarter else i - quarter
        angle = (row if i < quarter else col) * theta ** (-2 * j / half)
        a, b = v[i], v[i + half]
        out[i] = a * math.cos(angle) - b * math.sin(angle)
        out[i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def _reference_vit(
    vit: VisionTransformer, patches: torch.Tensor, n_h: int, n_w: int
) -> torch.Tensor:
    cfg = vit.vision
    sd = {k: v.double() for k, v in vit.state_dict().items()}
    n, dim, heads = n_h * n_w, cfg.hidden_size, cfg.num_attention_heads
    hd = dim // heads
    x = torch.stack(
        [sd["patch_embed.proj.weight"] @ patches[i] + sd["patch_embed.proj.bias"] for i in range(n)]
    )
    for b in range(cfg.num_hidden_layers):
        pre = f"blocks.{b}."
        h = torch.stack([_rms(x[i], sd[pre + "norm1.weight"]) for i in range(n)])
        qkv = h @ sd[pre + "attn.wqkv.weight"].T + sd[pre + "attn.wqkv.bias"]
        q, k, v = qkv[:, :dim], qkv[:, dim : 2 * dim], qkv[:, 2 * dim :]
        out = torch.zeros(n, dim, dtype=torch.float64)
        for head in range(heads):
            sl = slice(head * hd, (head + 1) * hd)
            qs = [_rotary_one(q[i, sl], i // n_w, i % n_w, cfg.rope_theta) for i in range(n)]
            ks = [_rotary_one(k[i, sl], i // n_w, i % n_w, cfg.rope_theta) for i in range(n)]
            for i in range(n):
                logits = torch.stack([qs[i] @ ks[j] / math.sqrt(hd) for j in range(n)])
                weights = torch.softmax(logits, 0)
                out[i, sl] = sum(weights[j] * v[j, sl] for j in range(n))
        x = x + out @ sd[pre + "attn.wo.weight"].T + sd[pre + "attn.wo.bias"]
        h = torch.stack([_rms(x[i], sd[pre + "norm2.weight"]) for i in range(n)])
        gu = h @ sd[pre + "mlp.w1.weight"].T
        inter = cfg.intermediate_size
        gate, up = gu[:, :inter], gu[:, inter:]
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[pre + "mlp.w2.weight"].T
    return torch.stack([_rms(x[i], sd["norm.weight"]) for i in range(n)])


def test_vit_matches_the_reference() -> None:
    vit = _randomised(VisionTransformer(SMALL), 0)
    n_h, n_w = 3, 4
    patches = torch.randn(
        n_h * n_w, 588, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    got = vit(patches, n_h, n_w)
    want = _reference_vit(vit, patches, n_h, n_w)
    # Not exact: the rotary angle table is fp32 in the model, as in the ports.
    assert torch.allclose(got, want, atol=1e-8, rtol=0)


def test_vit_attention_is_bidirectional_and_position_aware() -> None:
    vit = _randomised(VisionTransformer(SMALL), 2)
    patches = torch.randn(6, 588, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    base = vit(patches, 2, 3)
    later = patches.clone()
    later[5] += 1.0  # the last patch changes: the first one's output must too
    assert not torch.allclose(vit(later, 2, 3)[0], base[0])
    # Same patches laid out 3x2 instead of 2x3: the 2-D positions differ.
    assert not torch.allclose(vit(patches, 3, 2), base)


def _reference_aligner(aligner: Aligner, feats: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
    sd = {k: v.double() for k, v in aligner.state_dict().items()}
    r, c = aligner.ratio, feats.shape[1]
    rows = []
    for ci in range(-(-n_h // r)):
        for cj in range(-(-n_w // r)):
            vec = torch.zeros(c * r * r, dtype=torch.float64)
            for ch in range(c):
                for di in range(r):
                    for dj in range(r):
                        i, j = ci * r + di, cj * r + dj
                        if i < n_h and j < n_w:
                            vec[ch * r * r + di * r + dj] = feats[i * n_w + j, ch]
            hidden = sd["w1.weight"] @ vec + sd["w1.bias"]
            hidden = 0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))
            rows.append(sd["w2.weight"] @ hidden + sd["w2.bias"])
    return torch.stack(rows)


@pytest.mark.parametrize(("n_h", "n_w"), [(3, 6), (4, 5), (1, 1), (7, 2)])
def test_aligner_matches_the_reference(n_h: int, n_w: int) -> None:
    aligner = _randomised(Aligner(SMALL, 20), 4)
    feats = torch.randn(
        n_h * n_w, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    got = aligner(feats, n_h, n_w)
    assert got.shape == (-(-n_h // 3) * -(-n_w // 3), 20)
    assert torch.allclose(got, _reference_aligner(aligner, feats, n_h, n_w), atol=1e-10)


def test_merge_cells_pads_with_zeros() -> None:
    feats = torch.arange(4 * 2, dtype=torch.float64).view(4, 2) + 1  # a 2x2 grid, 2 channels
    cells = merge_cells(feats, 2, 2, 3)
    assert cells.shape == (1, 18)
    # channel 0 of the 3x3 cell: (0,0)=1 (0,1)=3 (1,0)=5 (1,1)=7, the rest zero padding
    assert cells[0, :9].tolist() == [1, 3, 0, 5, 7, 0, 0, 0, 0]


def test_span_layout() -> None:
    roles = span_roles(2, 3).tolist()
    assert roles == [0, 1, 1, 1, 2, 1, 1, 1, 2, 3]
    cells = torch.arange(6, dtype=torch.float64)[:, None].expand(6, 4) + 10
    start, nl, end = (torch.full((4,), v, dtype=torch.float64) for v in (-1.0, -2.0, -3.0))
    rows = span_rows(cells, 2, 3, start, nl, end)[:, 0].tolist()
    assert rows == [-1, 10, 11, 12, -2, 13, 14, 15, -2, -3]


def test_model_encode_image_end_to_end() -> None:
    """The model's tower: rows in span order, equal to ViT -> aligner -> span by hand."""
    config = with_vision(ModelConfig.tiny(), SMALL)
    model = DeepseekV41(config).double()
    model.init_weights(torch.Generator().manual_seed(0), std=0.2)
    assert model.vision is not None and model.aligner is not None
    plan = ImagePlan(70, 56, 70, 56, 14, 3)  # 4 x 5 patches -> 2 x 2 tokens
    patches = torch.randn(
        plan.n_patches, 588, generator=torch.Generator().manual_seed(9), dtype=torch.float64
    )
    rows = model.encode_image(patches, plan)
    assert rows.shape == (plan.tokens, config.hidden_size) == (8, 256)
    cells = model.aligner(model.vision(patches, 4, 5), 4, 5)
    assert torch.equal(rows[1:3], cells[0:2]) and torch.equal(rows[4:6], cells[2:4])
    assert torch.equal(rows[0], model.image_start) and torch.equal(rows[7], model.image_end)
    assert torch.equal(rows[3], model.image_newline) and torch.equal(rows[6], model.image_newline)
    # init: norms 1, biases 0, the span vectors random
    assert torch.equal(model.vision.blocks[0].norm1.weight, torch.ones(16, dtype=torch.float64))
    assert model.image_start.abs().sum() > 0
