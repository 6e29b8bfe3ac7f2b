"""Checkpoint weight formats: quantise for writing, dequantise for loading.

See docs/design/architecture.md §1.10 and §1.9.

Every scale is a power of two stored as an E8M0 byte; functions return scales
as ``torch.float8_e8m0fnu`` (safetensors ``F8_E8M0``, as the official
checkpoints store them) and accept that, raw ``uint8`` bytes, or a float
multiplier (V3-style ``weight_scale_inv``) when dequantising.

- Block FP8 linears: E4M3 ``[out, in]``, one scale per 32 x 32 block; ragged
  edge blocks are allowed.
- MXFP4 experts: E2M1 pairs in int8 ``[..., out, in / 2]`` (even element in the
  low nibble), one scale per 32 along ``in``.
- FP8 rows (Engram tables): E4M3 ``[..., dim]``, one scale per 32 along each row.

The exponent of a block is the smallest e with ``qmax * 2^e >= amax`` (qmax 448
for E4M3, 6 for E2M1), so nothing overflows; e >= -126 (all-zero blocks get
byte 1) and e <= 127. A block holding a NaN gets the E8M0 NaN byte 0xFF and
decodes to NaN throughout.
"""

from __future__ import annotations

import math

import torch

from kernels.quant import (
    E2M1_MAX,
    E4M3_MAX,
    E8M0_NAN_BYTE,
    e2m1_decode_packed,
    e2m1_encode,
    e4m3_encode,
    e4m3_from_bytes,
    e8m0_decode,
    e8m0_encode,
    pack_nibbles,
    pow2,
    pow2_exponent,
)

BLOCK = 32  # every scale covers 32 values along K (and 32 rows for block FP8)


def _scale_bytes(e: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    """E8M0 scales of exponents ``e``; NaN blocks get the NaN byte."""
    b = e8m0_encode(e)
    return torch.where(nan, torch.full_like(b, E8M0_NAN_BYTE), b).view(torch.float8_e8m0fnu)


def _scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Float32 multipliers from E8M0 scales (``float8_e8m0fnu`` / ``uint8``) or plain floats."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_decode(scale)
    return scale.float()


def _k_blocks(w: torch.Tensor, what: str) -> torch.Tensor:
    """``w [..., K]`` as float32 ``[..., K / 32, 32]``; K must be a multiple of 32."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"{what}: last dim {w.shape[-1]} is not a multiple of {BLOCK}")
    return w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)


# ----------------------------------------------------------------- block FP8 linears


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` -> (E4M3 ``[out, in]``, E8M0 ``[ceil(out/32), ceil(in/32)]``)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block: expected a 2-D weight, got {tuple(w.shape)}")
    rows, cols = w.shape
    rb, cb = math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)
    # Zero padding leaves every block's amax unchanged.
    padded = torch.zeros(rb * BLOCK, cb * BLOCK, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.float()
    blocks = padded.reshape(rb, BLOCK, cb, BLOCK)
    nan = torch.isnan(blocks).any(3).any(1)
    e = pow2_exponent(blocks.abs().amax((1, 3)), E4M3_MAX, E4M3_MAX * 2.0**-126)
    q = e4m3_encode(blocks / pow2(e)[:, None, :, None]).view(torch.uint8)
    q = torch.where(nan[:, None, :, None], torch.zeros_like(q), q)
    q = q.reshape(rb * BLOCK, cb * BLOCK)[:rows, :cols].contiguous()
    return q.view(torch.float8_e4m3fn), _scale_bytes(e, nan)


def dequantize_fp8_block(
    w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """E4M3 ``[out, in]`` (or its bytes) with per-32x32 scales -> ``dtype``: ``w * 2^(s-127)``."""
    rows, cols = w.shape
    want = (math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequantize_fp8_block: scale {tuple(scale.shape)}, want {want}")
    s = _scale_values(scale).repeat_interleave(BLOCK, 0)[:rows]
    s = s.repeat_interleave(BLOCK, 1)[:, :cols]
    return (e4m3_from_bytes(w) * s).to(dtype)


# ----------------------------------------------------------------- MXFP4 experts


def quantize_mxfp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., out, in]`` -> (int8 pairs ``[..., out, in/2]``, E8M0 ``[..., out, in/32]``)."""
    blocks = _k_blocks(w, "quantize_mxfp4_weight")
    nan = torch.isnan(blocks).any(-1)
    e = pow2_exponent(blocks.abs().amax(-1), E2M1_MAX, E2M1_MAX * 2.0**-126)
    codes = e2m1_encode(blocks / pow2(e)[..., None])
    codes = torch.where(nan[..., None], torch.zeros_like(codes), codes).flatten(-2)
    return pack_nibbles(codes).view(torch.int8), _scale_bytes(e, nan)


def dequantize_mxfp4_weight(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """int8/uint8 pairs ``[..., out, in/2]``, E8M0 ``[..., out, in/32]`` -> ``[..., out, in]``."""
    values = e2m1_decode_packed(packed)
    want = (*values.shape[:-1], values.shape[-1] // BLOCK)
    if tuple(scale.shape) != want or values.shape[-1] % BLOCK:
        raise ValueError(f"dequantize_mxfp4_weight: scale {tuple(scale.shape)}, want {want}")
    out = _k_blocks(values, "dequantize_mxfp4_weight") * _scale_values(scale)[..., None]
    return out.flatten(-2).to(dtype)


# ----------------------------------------------------------------- FP8 rows (Engram tables)


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., dim]`` -> (E4M3 ``[..., dim]``, E8M0 ``[..., dim/32]``)."""
    blocks = _k_blocks(w, "quantize_fp8_rows")
    nan = torch.isnan(blocks).any(-1)
    e = pow2_exponent(blocks.abs().amax(-1), E4M3_MAX, E4M3_MAX * 2.0**-126)
    q = e4m3_encode(blocks / pow2(e)[..., None]).view(torch.uint8)
    q = torch.where(nan[..., None], torch.zeros_like(q), q).flatten(-2)
    return q.view(torch.float8_e4m3fn), _scale_bytes(e, nan)


def dequantize_fp8_rows(
    w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """E4M3 ``[..., dim]`` (or its bytes) with E8M0 ``[..., dim/32]`` -> ``dtype [..., dim]``."""
    want = (*w.shape[:-1], w.shape[-1] // BLOCK)
    if tuple(scale.shape) != want or w.shape[-1] % BLOCK:
        raise ValueError(f"dequantize_fp8_rows: scale {tuple(scale.shape)}, want {want}")
    values = _k_blocks(e4m3_from_bytes(w), "dequantize_fp8_rows")
    return (values * _scale_values(scale)[..., None]).flatten(-2).to(dtype)
