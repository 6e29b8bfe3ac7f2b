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

from kernels.quant import E4M3_MAX, e4m3_encode, pow2, pow2_exponent

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
    scales = pow2(pow2_exponent(amax, E4M3_MAX, ACT_AMAX_FLOOR))
    values = e4m3_encode(blocks / scales[..., None]).flatten(-2)
    return values, scales


def dequantize_act_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``[..., K]`` from ``quantize_act_fp8``'s pair."""
    return (_blocks(values) * scales[..., None]).flatten(-2)


def fake_quant_act_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` through E4M3 per block of 32 and back, as float32."""
    return dequantize_act_fp8(*quantize_act_fp8(x))
