"""Dynamic activation quantisation before a packed GEMM (the release's ``act_quant``).

See docs/design/formats.md ("Activations before a packed GEMM").

The checkpoint's ``quantization_config`` says ``activation_scheme: dynamic``
with UE8M0 scales: before every FP8 (dense) or FP4 (expert) matmul the
release quantises its input to E4M3 per block of 32 along K, one power-of-two
scale per block, and accumulates the product in fp32. The block exponent is
``e = ceil(log2(max(amax, 1e-4) / 448))``, the rule of the SWA record, so an
all-zero block gets 2^-22 and nothing overflows.
"""

from __future__ import annotations

import torch

from kernels.quant import e4m3_encode

ACT_BLOCK = 32
ACT_AMAX_FLOOR = 1e-4


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % ACT_BLOCK:
        raise ValueError(
            f"activation quantisation: last dim {x.shape[-1]} is not a multiple of {ACT_BLOCK}"
        )
    return x.float().unflatten(-1, (x.shape[-1] // ACT_BLOCK, ACT_BLOCK))


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` -> (E4M3 ``[..., K]``, float32 power-of-two scales ``[..., K / 32]``).

    ``values.float() * scales`` (broadcast per block) is the quantised activation.
    A NaN is carried by its own E4M3 value; the block's scale ignores it, so
    its neighbours quantise as if it were absent.
    """
    blocks = _blocks(x)
    amax = blocks.abs().nan_to_num(nan=0.0).amax(-1)
    scales = block_scales(amax)
    values = e4m3_encode(blocks / scales[..., None]).flatten(-2)
    return values, scales


def block_scales(amax: torch.Tensor) -> torch.Tensor:
    """``2^e`` with ``e = ceil(log2(max(amax, 1e-4) / 448))`` (inf: 2^127), from amax's bits.

    ``pow2(pow2_exponent(amax, 448, 1e-4))`` in a few integer ops (this runs before
    every packed GEMM): with ``a = 1.f * 2^(F - 127)`` and ``448 = 1.75 * 2^8`` the
    exponent is ``F - 135``, plus one when ``1.f > 1.75`` (the fraction bits above
    0x600000); the scale's float32 bits are its biased exponent shifted into place.
    The floor keeps every finite amax's exponent within [-22, 120].
    """
    bits = amax.float().clamp(min=ACT_AMAX_FLOOR).view(torch.int32)
    field = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    field = field.masked_fill_(bits >= 0x7F800000, 254)  # inf: 2^127, as the exact rule
    return (field << 23).view(torch.float32)


def dequantize_act_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``[..., K]`` from ``quantize_act_fp8``'s pair."""
    return (_blocks(values) * scales[..., None]).flatten(-2)


def fake_quant_act_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` through E4M3 per block of 32 and back, as float32."""
    return dequantize_act_fp8(*quantize_act_fp8(x))
