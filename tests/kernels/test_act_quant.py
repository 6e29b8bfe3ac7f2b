"""Activation quantisation against hand-computed blocks."""

import math

import pytest
import torch

from kernels.act_quant import (
    block_scales,
    dequantize_act_fp8,
    fake_quant_act_fp8,
    quantize_act_fp8,
)
from kernels.quant import E4M3_MAX, pow2, pow2_exponent


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
