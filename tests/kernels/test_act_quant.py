"""Activation quantisation against hand-computed blocks."""

import math

import pytest
import torch

from kernels.act_quant import (
    ACT_AMAX_FLOOR,
    dequantize_act_fp8,
    fake_quant_act_fp8,
    quantize_act_e4m3,
    quantize_act_fp8,
)
from kernels.quant import E4M3_MAX, e4m3_encode, pow2, pow2_exponent


def block_scales(amax: torch.Tensor) -> torch.Tensor:
    """``2^e`` with ``e = ceil(log2(max(amax, 1e-4) / 448))`` (inf: 2^127), from amax's bits.

    The bit trick of the Triton GEMM's ``act_exponent`` (kernels/triton/fp8_gemm.py),
    in PyTorch so that it can be held to the exact rule on a CPU: with
    ``a = 1.f * 2^(F - 127)`` and ``448 = 1.75 * 2^8`` the exponent is
    ``F - 135``, plus one when ``1.f > 1.75`` (the fraction bits above
    0x600000); the scale's float32 bits are its biased exponent shifted into place.
    The floor keeps every finite amax's exponent within [-22, 120].
    """
    bits = amax.float().clamp(min=ACT_AMAX_FLOOR).view(torch.int32)
    field = (bits >> 23) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    field = field.masked_fill_(bits >= 0x7F800000, 254)  # inf: 2^127, as the exact rule
    return (field << 23).view(torch.float32)


def test_block_scale_is_the_smallest_power_of_two_that_fits() -> None:
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-3.0, 3.0, 32)  # amax 3: 3/448 -> 2^-7 (0.0078 >= 0.0067)
    x[0, 32:] = 448.0  # exactly fits at 2^0
    x[1, 0] = 449.0  # just over: 2^1
    values, scales = quantize_act_fp8(x)
    assert scales.tolist() == [[2.0**-7, 1.0], [2.0, 2.0**-22]]  # zero block: the 1e-4 floor
    assert values.dtype == torch.float8_e4m3fn
    # 448 at scale 1 is the E4M3 maximum, kept exactly; 449 / 2 rounds to 224.
    assert values.float()[0, 32].item() == 448.0
    assert values.float()[1, 0].item() == 224.0


def test_round_trip_error_is_bounded_by_e4m3_precision() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 96) * torch.logspace(-3, 3, 96)
    y = fake_quant_act_fp8(x)
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values.
    scales = quantize_act_fp8(x)[1].repeat_interleave(32, -1)
    normal = x.abs() >= scales * 2.0**-6
    assert torch.all((y - x).abs()[normal] <= x.abs()[normal] * 2.0**-4)
    assert torch.equal(dequantize_act_fp8(*quantize_act_fp8(y)), y)  # idempotent


def test_nan_stays_in_its_block_and_ragged_k_is_refused() -> None:
    x = torch.ones(1, 64)
    x[0, 3] = math.nan
    y = fake_quant_act_fp8(x)
    assert torch.isnan(y[0, 3]) and torch.equal(y[0, 32:], torch.ones(32))
    assert torch.equal(y[0, :3], torch.ones(3))  # the scale ignores the NaN
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_act_fp8(torch.ones(1, 40))


def test_block_scales_from_bits_equal_the_exact_exponent_rule() -> None:
    """The bit-level scale equals ``pow2(pow2_exponent(...))`` (frexp, exact) on random
    magnitudes and on every boundary: powers of two, 448 * 2^k and its neighbours,
    the 1e-4 floor, the largest finite float and infinity."""
    torch.manual_seed(0)
    random = torch.exp(torch.empty(20000).uniform_(-30.0, 80.0))
    k = torch.arange(-30.0, 120.0)
    edges = torch.cat([2.0**k, 448.0 * 2.0**k])
    edges = torch.cat([edges, torch.nextafter(edges, edges * 2), torch.nextafter(edges, edges * 0)])
    special = torch.tensor([0.0, 1e-4, 9.9e-5, 3.4028235e38, float("inf")])
    amax = torch.cat([random, edges, special]).float()
    want = pow2(pow2_exponent(amax, E4M3_MAX, 1e-4))
    assert torch.equal(block_scales(amax), want)


def _exact_rule(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The release's rule step by step: amax ignoring NaN (an inf counts as the largest
    float, as ``nan_to_num`` gives), ``2^ceil(log2(max(amax, 1e-4) / 448))`` through
    frexp, then E4M3 of ``x / scale`` through ``e4m3_encode`` (saturating cast)."""
    blocks = x.float().unflatten(-1, (x.shape[-1] // 32, 32))
    amax = blocks.abs().nan_to_num(nan=0.0).amax(-1)
    scales = pow2(pow2_exponent(amax, E4M3_MAX, 1e-4))
    return e4m3_encode(blocks / scales[..., None]).flatten(-2), scales


def _boundary_rows() -> torch.Tensor:
    """Blocks of 32 that put the scaled values on every E4M3 boundary.

    Each block's amax is 448 * 2^j (so its scale is exactly 2^j) and its other 31
    values, times 2^j, are: E4M3 subnormals and their round-half-even ties (odd
    multiples of 2^-10), the smallest normal 2^-6 and its neighbours, ties between
    neighbouring normals at every exponent, the largest value 448 and 464 (over it),
    zeros of both signs, float32 subnormals, NaN and +-inf.
    """
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = grid[torch.isfinite(grid)].unique()
    mids = (finite[1:] + finite[:-1]) / 2  # every tie between neighbours
    values = torch.cat(
        [
            finite,
            mids,
            torch.nextafter(mids, mids + 1),
            torch.nextafter(mids, mids - 1),
            torch.tensor([2.0**-6, 2.0**-7, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-11]),
            torch.tensor([448.0, 447.9, 464.0, 0.0, -0.0, 1e-40, -1e-45]),
        ]
    )
    values = torch.cat([values, -values])
    pad = (-values.numel()) % 31
    values = torch.cat([values, torch.zeros(pad)]).view(-1, 31)
    rows = []
    for j in (-22, -9, 0, 5, 40):
        block = torch.cat([torch.full((values.shape[0], 1), 448.0), values], dim=1) * 2.0**j
        rows.append(block.flatten())
    special = torch.zeros(4 * 32)
    special[3] = math.nan  # NaN in a block: the scale ignores it
    special[7] = 5.0
    special[32] = math.inf  # inf: amax is the largest float, the value saturates
    special[33] = 1.0
    special[64] = -math.inf
    special[96:128] = torch.finfo(torch.float32).max  # the largest float itself
    floor = torch.tensor(1e-4)
    near_floor = torch.zeros(4, 32)  # amax at, just under and just over the 1e-4 floor
    near_floor[:, 0] = torch.stack(
        [floor, torch.nextafter(floor, floor * 0), torch.nextafter(floor, floor * 2), floor / 2]
    )
    near_floor[:, 1] = -near_floor[:, 0] / 3
    flat = torch.cat([*rows, special, near_floor.flatten()])
    flat = torch.cat([flat, torch.zeros((-flat.numel()) % 64)])
    return flat.view(-1, 64)


@pytest.mark.parametrize("rows", [1, 3, 40])  # below and above the cast/table switch
def test_fused_quantiser_equals_the_exact_rule_bitwise(rows: int) -> None:
    """``quantize_act_fp8`` / ``quantize_act_e4m3`` (fused: the scale from amax's bits,
    in-place ops, values read back by cast or by table) give the exact rule's bytes
    and scales on random magnitudes over 2^-30..2^60 and on every boundary."""
    torch.manual_seed(rows)
    spread = 2.0 ** torch.randint(-30, 60, (rows, 8, 1)).float()
    random = (torch.randn(rows, 8, 32) * spread).flatten(1)
    for x in (random, _boundary_rows(), _boundary_rows()[: max(rows // 4, 1)]):
        want_values, want_scales = _exact_rule(x)
        values, scales = quantize_act_fp8(x)
        assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
        assert torch.equal(scales.view(torch.int32), want_scales.view(torch.int32))
        as_float, scales32 = quantize_act_e4m3(x)
        assert as_float.dtype == torch.float32
        assert torch.equal(scales32.view(torch.int32), want_scales.view(torch.int32))
        same = (as_float == want_values.float()) | (as_float.isnan() & want_values.float().isnan())
        assert bool(same.all())
        assert torch.equal(as_float.signbit(), want_values.float().signbit())  # -0.0 kept


def test_fused_quantiser_reads_bf16_and_float64_like_their_float32_values() -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 96) * 100
    for t in (x.bfloat16(), x.double()):
        values, scales = quantize_act_fp8(t)
        want_values, want_scales = _exact_rule(t.float())
        assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
        assert torch.equal(scales, want_scales)
