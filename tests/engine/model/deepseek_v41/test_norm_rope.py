from __future__ import annotations

import math

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.norm import RMSNorm
from engine.model.deepseek_v41.rope import (
    apply_rope,
    plain_inv_freq,
    rope_inv_freq,
    rope_inv_freq_for_ratio,
    rope_tail,
)


def _yarn64(d: int, theta: float, factor: float, orig: int) -> list[float]:
    """docs/design/architecture.md §1.5 evaluated term by term in Python floats."""
    low = math.floor(d * math.log(orig / (32 * 2 * math.pi)) / (2 * math.log(theta)))
    high = math.ceil(d * math.log(orig / (1 * 2 * math.pi)) / (2 * math.log(theta)))
    low, high = max(low, 0), min(high, d - 1)
    out = []
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return out


def _rope_complex64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, sign: float = 1.0):
    """Rotation as complex multiplication: (x_2i + i x_2i+1) * exp(i pos f_i), float64.

    The angle ``pos * f_i`` is the fp32 product, as the release forms it."""
    x64 = x.double()
    z = torch.complex(x64[..., 0::2], x64[..., 1::2])
    angle = (pos.float()[:, None] * inv_freq.float()[None, :]).double() * sign
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (inv_freq.shape[0],)
    z = z * torch.polar(torch.ones_like(angle), angle).view(shape)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def test_yarn_frequencies_official_match_hand_formula():
    config = ModelConfig.official()
    got = rope_inv_freq(config, 20)  # ratio 1 layer
    want = torch.tensor(_yarn64(64, 160000.0, 16.0, 65536), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    # Hand-derived band for d=64, theta=160000: low = floor(15.45) = 15, high = ceil(24.71) = 25.
    plain = 160000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    torch.testing.assert_close(got[:16].double(), plain[:16], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[25:].double(), plain[25:] / 16, rtol=1e-6, atol=0)
    torch.testing.assert_close(got[20].double(), plain[20] * (0.5 / 16 + 0.5), rtol=1e-6, atol=0)
    # Every ratio>0 layer shares them; the ratio-2 layers too.
    torch.testing.assert_close(rope_inv_freq(config, 2), got, rtol=0, atol=0)
    torch.testing.assert_close(rope_inv_freq_for_ratio(config, 2), got, rtol=0, atol=0)


def test_ratio0_layers_use_plain_rope_theta():
    config = ModelConfig.official()
    got = rope_inv_freq(config, 0)
    assert got.dtype == torch.float32 and got.shape == (32,)
    assert got[0].item() == 1.0
    assert got[1].item() == pytest.approx(10000.0 ** (-1 / 32), rel=1e-7)
    torch.testing.assert_close(got, plain_inv_freq(64, 10000.0))
    # DSpark blocks (ratio 0, ids past the backbone) are plain too.
    torch.testing.assert_close(rope_inv_freq(config, 40), got)


def test_apply_rope_matches_complex_multiplication():
    g = torch.Generator().manual_seed(0)
    inv_freq = rope_inv_freq(ModelConfig.tiny(), 2)
    x = torch.randn(6, 3, 64, generator=g)
    # Up to the 1M context: the angle is the release's fp32 product even there.
    pos = torch.tensor([0, 1, 5, 17, 100_000, 1_048_575])
    got = apply_rope(x, pos, inv_freq)
    torch.testing.assert_close(got.double(), _rope_complex64(x, pos, inv_freq), rtol=0, atol=2e-5)
    inv = apply_rope(x, pos, inv_freq, inverse=True)
    torch.testing.assert_close(
        inv.double(), _rope_complex64(x, pos, inv_freq, sign=-1.0), rtol=0, atol=2e-5
    )
    # Position 0 is the identity, and a 2D [T, d] input broadcasts the same way.
    torch.testing.assert_close(got[0], x[0])
    torch.testing.assert_close(apply_rope(x[:, 1], pos, inv_freq), got[:, 1])


def test_inverse_undoes_forward_and_keeps_dtype():
    inv_freq = rope_inv_freq(ModelConfig.tiny(), 0)
    x = torch.randn(5, 2, 64, generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([3, 9, 64, 511, 4096])
    back = apply_rope(apply_rope(x, pos, inv_freq), pos, inv_freq, inverse=True)
    torch.testing.assert_close(back, x, rtol=0, atol=1e-5)
    assert apply_rope(x.bfloat16(), pos, inv_freq).dtype == torch.bfloat16


def test_rope_tail_rotates_only_last_64_dims():
    inv_freq = rope_inv_freq(ModelConfig.tiny(), 4)
    x = torch.randn(4, 3, 512, generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([0, 2, 7, 30])
    got = rope_tail(x, pos, inv_freq)
    assert torch.equal(got[..., :448], x[..., :448])
    torch.testing.assert_close(
        got[..., 448:].double(), _rope_complex64(x[..., 448:], pos, inv_freq), rtol=0, atol=2e-5
    )
    assert not torch.allclose(got[1:, :, 448:], x[1:, :, 448:])


def test_rmsnorm_matches_float64_formula():
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(16, 1e-20)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    x = torch.randn(5, 16, generator=g) * 3
    x64 = x.double()
    want = x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + 1e-20) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), want, rtol=1e-6, atol=1e-6)
    # eps 1e-20 on an all-zero row: zeros, not NaN.
    assert torch.equal(norm(torch.zeros(1, 16)), torch.zeros(1, 16))
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_rope_cos_sin_reuse_follows_in_place_changes():
    """(cos, sin) are reused for the same positions tensor, and recomputed once it changes."""
    from engine.model.deepseek_v41.rope import rope_cos_sin

    inv_freq = torch.tensor([1.0, 0.5, 0.25])
    pos = torch.tensor([0, 3, 7])
    first = rope_cos_sin(pos, inv_freq)
    assert rope_cos_sin(pos, inv_freq)[0] is first[0]  # reused
    pos += 1  # in place: a new version
    cos, sin = rope_cos_sin(pos, inv_freq)
    angle = torch.tensor([1.0, 4.0, 8.0])[:, None] * inv_freq[None, :]
    assert torch.equal(cos, angle.cos()) and torch.equal(sin, angle.sin())
