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

from kernels.quant import E4M3_MAX, e4m3_from_bytes

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
    scaled, scales = _scaled_blocks(x)
    return scaled.to(torch.float8_e4m3fn).flatten(-2), scales


def quantize_act_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act_fp8`` with the E4M3 values as float32 (equal, value for value).

    What the CPU GEMMs consume: PyTorch's float8 -> float32 cast costs some
    10 ns per element on the CPU, so above ``_CAST_BELOW`` elements the values
    are read back from their bytes through a 256-entry table instead.
    """
    scaled, scales = _scaled_blocks(x)
    fp8 = scaled.to(torch.float8_e4m3fn)
    if fp8.numel() < _CAST_BELOW:
        return fp8.float().flatten(-2), scales
    return e4m3_from_bytes(fp8).flatten(-2), scales


# Elements below which a float8 -> float32 cast beats the table gather (the
# gather is about 2x faster at 2,048 on the 2-core VM and 4x at 16K).
_CAST_BELOW = 1024
# The float32 exponent field: what a block scale keeps of amax's shifted bits.
_EXPONENT_BITS = 0x7F800000
# 2^e >= a / 448 for a = 1.f * 2^(F - 127): e = F - 135, plus one when 1.f > 1.75
# (fraction bits above 0x600000). Adding 0x1FFFFF carries into the exponent field
# exactly then; subtracting 8 << 23 takes 448 = 1.75 * 2^8 off. One integer op.
_SCALE_OFFSET = (8 << 23) - 0x1FFFFF
_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _scaled_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x / scale`` per block, saturated to +-448, ``[..., K / 32, 32]``; the scales).

    The fused form of ``e4m3_encode(blocks / pow2(pow2_exponent(nan-free amax, 448, 1e-4)))``:
    eight
    tensor ops, intermediates updated in place. An inf in a block gives the scale
    2^120, as the rule's ``nan_to_num`` (inf -> the largest float) does; the value
    saturates to 448.
    """
    blocks = _blocks(x)
    offset, mask, floor = _constants(x.device)
    # fmax ignores NaN, so this is the floored amax without NaNs in one op; an inf
    # stays inf, whose scale below is 2^120 as the largest float's is.
    amax = torch.fmax(blocks.abs(), floor).amax(-1)
    bits = amax.view(torch.int32).sub_(offset).bitwise_and_(mask)
    scales = bits.view(torch.float32)
    # Dividing by a power of two is exact (or the correctly rounded underflow,
    # as a multiply by its reciprocal would give); E4M3 rounds only in the cast.
    scaled = torch.div(blocks, scales[..., None]).clamp_(-E4M3_MAX, E4M3_MAX)
    return scaled, scales


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_SCALE_OFFSET``, ``_EXPONENT_BITS`` (0-d int32) and the amax floor (0-d float32)
    as tensors: an integer op with a Python int wraps the scalar on every call, which
    costs more than the op (some 10 us against 2 on the 2-core VM), and ``fmax`` takes
    tensors only."""
    consts = _CONSTANTS.get(device)
    if consts is None:
        consts = (
            torch.tensor(_SCALE_OFFSET, dtype=torch.int32, device=device),
            torch.tensor(_EXPONENT_BITS, dtype=torch.int32, device=device),
            torch.tensor(ACT_AMAX_FLOOR, dtype=torch.float32, device=device),
        )
        _CONSTANTS[device] = consts
    return consts


def dequantize_act_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Float32 ``[..., K]`` from ``quantize_act_fp8``'s pair."""
    return (_blocks(values) * scales[..., None]).flatten(-2)


def fake_quant_act_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` through E4M3 per block of 32 and back, as float32."""
    return dequantize_act_fp8(*quantize_act_fp8(x))
