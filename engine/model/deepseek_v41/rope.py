"""Rotary position embedding of V4.1 (docs/design/architecture.md §1.5).

GPT-J style: the pair (2i, 2i+1) is rotated by the angle ``pos * f_i``. Only the
last ``qk_rope_head_dim`` (64) dims of a vector carry RoPE. Ratio-0 layers use
plain frequencies with ``rope_theta``; ratio>0 layers (their queries, SWA keys,
compressed keys and indexer queries/keys alike) use ``compress_rope_theta`` with
YaRN and no attention mscale.
"""

from __future__ import annotations

import math

import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.precision import upcast


def plain_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """``f_i = theta^(-2i/dim)`` for i = 0 .. dim/2 - 1, computed in fp32 as the release does."""
    exponent = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    return 1.0 / theta**exponent


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    beta_fast: float,
    beta_slow: float,
    original_max_position: int,
) -> torch.Tensor:
    """YaRN-interpolated frequencies exactly as docs/design/architecture.md §1.5 writes them.

    Pairs rotating fast (index < low) keep ``f_i``; slow ones (> high) become
    ``f_i / factor``; a linear ramp blends the band between.
    """
    f = plain_inv_freq(dim, theta)

    def correction_dim(rotations: float) -> float:
        # The pair index whose wavelength fits `rotations` times in the original context.
        return (
            dim
            * math.log(original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp is a step; avoid 0/0 as public ports do
    i = torch.arange(dim // 2, dtype=torch.float32)
    ramp = ((i - low) / (high - low)).clamp(0.0, 1.0)
    return f / factor * ramp + f * (1.0 - ramp)


def rope_inv_freq_for_ratio(config: ModelConfig, ratio: int) -> torch.Tensor:
    """Frequencies of a layer with compress ratio ``ratio`` (0 = plain RoPE)."""
    dim = config.qk_rope_head_dim
    if ratio == 0:
        return plain_inv_freq(dim, config.rope_theta)
    rs = config.rope_scaling
    return yarn_inv_freq(
        dim,
        config.compress_rope_theta,
        rs.factor,
        rs.beta_fast,
        rs.beta_slow,
        rs.original_max_position_embeddings,
    )


def rope_inv_freq(config: ModelConfig, layer_id: int) -> torch.Tensor:
    """``Tensor[qk_rope_head_dim / 2]`` fp32 frequencies of layer ``layer_id``."""
    return rope_inv_freq_for_ratio(config, config.compress_ratios[layer_id])


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, len(inv_freq)] fp32 of the angles ``positions[t] * inv_freq[i]``.

    The angle is the fp32 product, as the release forms it: a float64 angle
    would be more accurate (fp32 loses ~pos * 6e-8 rad) but rotates by other
    angles than the model was trained with, and the 1e-7 differences flip
    FP8/FP4 roundings downstream. Kernels build their cos/sin tables from this
    function so they rotate by the same angles as the reference.
    """
    key = (id(positions), positions._version, id(inv_freq), inv_freq._version)
    hit = _COS_SIN.get(key)
    # The entry holds both tensors, so their ids cannot be reused while it lives.
    if hit is not None and hit[0] is positions and hit[1] is inv_freq:
        return hit[2], hit[3]
    angle = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos, sin = angle.cos(), angle.sin()
    if not positions.requires_grad and not inv_freq.requires_grad:
        if len(_COS_SIN) >= _COS_SIN_ENTRIES:
            _COS_SIN.clear()
        _COS_SIN[key] = (positions, inv_freq, cos, sin)
    return cos, sin


# A layer rotates its queries, SWA key and output at the same positions with the
# same frequencies: (cos, sin) is computed once per (positions, frequencies)
# tensor pair and version. Callers must not modify the returned tensors.
_COS_SIN_ENTRIES = 16
_COS_SIN: dict[
    tuple[int, int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
] = {}


def clear_cos_sin_cache() -> None:
    """Forget every cached (cos, sin): a captured graph must compute its own angles
    (a cached pair from outside the graph would be read stale at replay)."""
    _COS_SIN.clear()


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate every interleaved pair of ``x`` by ``positions[t] * inv_freq[i]``.

    ``x`` is ``[T, ..., 2 * len(inv_freq)]``: dim 0 is the token axis that
    ``positions`` (``[T]``) indexes; any middle dims (heads) share the token's
    angle. ``inverse`` rotates by the negative angle. The rotation runs in
    fp32 and the result has ``x``'s dtype.
    """
    assert x.shape[-1] == 2 * inv_freq.shape[0], (x.shape, inv_freq.shape)
    assert positions.shape == (x.shape[0],), (positions.shape, x.shape)
    cos, sin = rope_cos_sin(positions, inv_freq)
    if inverse:
        sin = -sin
    broadcast = (x.shape[0],) + (1,) * (x.dim() - 2) + (inv_freq.shape[0],)
    cos, sin = cos.view(broadcast), sin.view(broadcast)
    pairs = upcast(x).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def rope_tail(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    inverse: bool = False,
) -> torch.Tensor:
    """RoPE on the last ``2 * len(inv_freq)`` dims of ``x`` [T, ..., d]; the rest untouched."""
    rope_dim = 2 * inv_freq.shape[0]
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    return torch.cat((head, apply_rope(tail, positions, inv_freq, inverse=inverse)), dim=-1)
