"""Packed block-FP8 linear: the CPU path and the Triton kernel (interpreted, in a child)
against ``fp8_linear_reference``, the same arithmetic in float64.

"To fp32 rounding": every E4M3 x E4M3 product and every power-of-two scaling is
exact, so a path may differ from the float64 reference only by its fp32 sums:
at most ``K * 2^-24 * sum_k |xq_k w_k|`` (the standard bound for a K-term sum),
plus half an ulp of the output dtype when it is rounded (bf16: 2^-8 relative).
Seeds are fresh each run and printed (``FLASHSERVE_TEST_SEED`` replays one).
"""

from __future__ import annotations

import math
import os
import secrets

import pytest
import torch
from interpreter import INTERPRETED, interpreted, run_triton_tests_in_child

from kernels import act_memo, dispatch
from kernels import fp8_gemm as fp8_gemm_module
from kernels.act_quant import quantize_act_e4m3
from kernels.fp8_gemm import (
    fp8_linear,
    fp8_linear_cpu,
    fp8_linear_reference,
    prepare_scales,
    tile_rows,
)
from kernels.weight_formats import quantize_fp8_block


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("FLASHSERVE_TEST_SEED", secrets.randbits(31)))
    print(f"seed={value}")
    return value


def random_packed(
    g: torch.Generator, n: int, k: int, scale_bytes: tuple[int, int] = (110, 135)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite E4M3 byte (subnormals and both zeros included) and random E8M0 scales."""
    b = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)  # no NaN bytes here
    lo, hi = scale_bytes
    s = torch.randint(lo, hi + 1, (math.ceil(n / 32), math.ceil(k / 32)), generator=g)
    return b.to(torch.uint8).view(torch.float8_e4m3fn), s.to(torch.uint8).view(torch.float8_e8m0fnu)


def activations(g: torch.Generator, t: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-block magnitudes over several octaves, so block scales differ."""
    octave = torch.randint(-4, 5, (t, k // 32, 1), generator=g).float()
    x = torch.randn(t, k // 32, 32, generator=g) * 2.0**octave
    return x.flatten(1).to(dtype)


def assert_fp32_close(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, out_ulps: float = 0.5
):
    """``got`` equals the float64 reference to the rounding of fp32 sums (module docstring).

    ``out_ulps``: the rounding of a 16-bit output, in its ulps (the Triton interpreter
    truncates fp32 stored as bf16: one ulp)."""
    want = fp8_linear_reference(x, w, s)
    magnitude = fp8_linear_reference(x.abs(), (w.view(torch.uint8) & 0x7F).view(w.dtype), s)
    bound = x.shape[-1] * 2.0**-24 * magnitude
    if got.dtype != torch.float32:
        bound = bound + (want.abs() + bound) * torch.finfo(got.dtype).eps * out_ulps
    assert got.shape == want.shape and got.dtype == x.dtype
    err = (got.double() - want).abs()
    assert torch.all(err <= bound), (err - bound).max()


# ----------------------------------------------------------------- CPU path


@pytest.mark.parametrize(
    ("t", "n", "k"),
    [
        (1, 64, 64),  # decode: activations scaled per weight row block
        (3, 70, 96),  # ragged last row block
        (16, 33, 32),
        (40, 100, 64),  # prefill: the weight tile scaled
        (0, 40, 32),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_equals_the_float64_reference(seed, t, n, k, dtype):
    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, n, k)
    x = activations(g, t, k, dtype)
    assert_fp32_close(fp8_linear_cpu(x, w, s), x, w, s)


@pytest.mark.parametrize("t", [2, 24])
def test_several_tiles_equal_one(seed, t, monkeypatch):
    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, 200, 64)
    x = activations(g, t, 64, torch.float32)
    one = fp8_linear_cpu(x, w, s)
    monkeypatch.setattr(fp8_gemm_module, "TILE_ELEMENTS", 64 * 64)
    assert tile_rows(200, 64) == 64  # tiles of 64, 64, 64 and 8 rows
    tiled = fp8_linear_cpu(x, w, s)
    # Not bitwise: BLAS may sum a 64-row product in another order than a 200-row one
    # (an AMD EPYC build machine does for 24 rows, 2026-12-01). Both are the float64
    # reference to fp32 rounding, and the tiles are where they belong.
    assert_fp32_close(one, x, w, s)
    assert_fp32_close(tiled, x, w, s)
    for r0 in range(0, 200, 64):
        part = fp8_linear_cpu(x, w[r0 : r0 + 64], s[r0 // 32 : (r0 + 64 + 31) // 32])
        assert torch.equal(tiled[:, r0 : r0 + 64], part)


def test_float64_input_equals_the_reference_exactly(seed):
    """float64 (the engine's exact mode): every step is exact but the sum, done in float64."""
    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, 96, 64)
    for t in (1, 20):
        x = activations(g, t, 64, torch.float64)
        got = fp8_linear(x, w, s)
        assert got.dtype == torch.float64
        assert torch.allclose(got, fp8_linear_reference(x, w, s), rtol=1e-13, atol=0)


def test_huge_scales_do_not_overflow_the_decode(seed):
    """Scale bytes of 2^120 and more cannot take the 256x decode factor: the tile takes it."""
    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, 64, 64, scale_bytes=(246, 250))
    x = activations(g, 2, 64, torch.float32) * 2.0**-120
    got = fp8_linear_cpu(x, w, s)
    assert torch.isfinite(got).all()
    assert_fp32_close(got, x, w, s)


def test_quantised_weights_give_a_close_linear():
    """End to end against a plain float GEMM: only the two E4M3 roundings separate them."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * 0.02
    x = torch.randn(5, 128, generator=g)
    q, s = quantize_fp8_block(w)
    got = fp8_linear(x, q, s)
    want = x @ w.T
    # Each side keeps 3 mantissa bits (relative error <= 2^-4 per element, random signs).
    assert (got - want).norm() / want.norm() < 0.06


def test_nan_byte_poisons_its_column_only(seed):
    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, 40, 64)
    raw = w.view(torch.uint8).clone()
    raw[7, 3] = 0xFF  # E4M3 NaN
    w = raw.view(torch.float8_e4m3fn)
    x = activations(g, 3, 64, torch.float32)
    for t in (x[:1], x):  # both CPU schemes
        got = fp8_linear_cpu(t, w, s)
        assert torch.isnan(got[:, 7]).all()
        assert torch.isfinite(got[:, torch.arange(40) != 7]).all()
        assert torch.isnan(fp8_linear_reference(t, w, s)[:, 7]).all()


def test_shapes_are_checked():
    w, s = random_packed(torch.Generator().manual_seed(0), 40, 64)
    with pytest.raises(ValueError, match="features"):
        fp8_linear(torch.ones(2, 32), w, s)
    with pytest.raises(ValueError, match="scale"):
        fp8_linear(torch.ones(2, 64), w, s[:1])
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_linear(torch.ones(2, 64), torch.ones(40, 64), s)
    w40, s40 = random_packed(torch.Generator().manual_seed(0), 8, 40)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8_linear(torch.ones(1, 40), w40, s40)


def test_leading_dims_are_kept(seed):
    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, 48, 64)
    x = activations(g, 6, 64, torch.float32)
    got = fp8_linear(x.view(2, 3, 64), w, s)
    assert got.shape == (2, 3, 48)
    assert torch.equal(got.view(6, 48), fp8_linear(x, w, s))


@pytest.mark.parametrize("t", [1, 5, 16])
def test_kept_views_path_equals_the_general_tile_path_bitwise(seed, t):
    """The one-tile act-side path (kept scratch views) does the general path's operations."""
    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, 96, 64)
    x = activations(g, t, 64, torch.float32)
    xq, act_scales = quantize_act_e4m3(x)
    p = prepare_scales(s, torch.float32)
    codes, tile = torch.empty(96 * 64, dtype=torch.int16), torch.empty(96 * 64)
    raw = w.view(torch.int8)
    general = fp8_gemm_module._tile_product(
        xq, act_scales, raw, codes, tile, p.values, p.folded, None, True
    )
    assert torch.equal(fp8_linear_cpu(x, w, s), general)
    assert torch.equal(fp8_linear_cpu(x, raw, s, nan_free=True, prepared=p), general)


def test_a_shared_input_and_out_dtype_give_the_same_bits(seed):
    """The memoised quantisation of one input serves several GEMMs unchanged, and
    ``out_dtype`` is the fp32 result of the upcast input."""
    act_memo.clear()
    g = torch.Generator().manual_seed(seed)
    w1, s1 = random_packed(g, 64, 96)
    w2, s2 = random_packed(g, 40, 96)
    x = activations(g, 3, 96, torch.bfloat16)
    a, b = fp8_linear(x, w1, s1), fp8_linear(x, w2, s2)  # the second reuses x's quantisation
    assert len(act_memo._MEMO.entries) == 1
    assert torch.equal(a, fp8_linear(x.clone(), w1, s1))
    assert torch.equal(b, fp8_linear(x.clone(), w2, s2))
    wide = fp8_linear(x, w1, s1, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, fp8_linear(x.float(), w1, s1))


# ----------------------------------------------------------------- Triton (interpreted)


@pytest.mark.skipif(INTERPRETED, reason="this is the driver; the child runs the tests")
def test_triton_kernels_interpreted():
    """This file's Triton tests, run in a TRITON_INTERPRET=1 child (triton is a dependency)."""
    run_triton_tests_in_child(__file__)


@interpreted
@pytest.mark.parametrize(("m", "n", "k"), [(5, 70, 64), (17, 32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_triton_equals_reference(seed, m, n, k, dtype):
    """fp32 and bf16 activations (loaded as they are, computed in fp32), ragged N."""
    from kernels.triton.fp8_gemm import fp8_linear_triton

    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, n, k)
    x = activations(g, m, k, dtype)
    out = torch.full((m, n), math.nan, dtype=dtype)  # every element must be written
    got = fp8_linear_triton(x, w, s, out=out, block_m=16, block_n=32)
    assert_fp32_close(got, x, w, s, out_ulps=1.0)


@interpreted
def test_triton_activation_exponent_ties_and_nan(seed):
    """Blocks whose amax is exactly 448 * 2^e, just above it, zero, or holding a NaN."""
    from kernels.triton.fp8_gemm import fp8_linear_triton

    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, 32, 128)
    x = torch.randn(16, 128, generator=g)
    x[0, :32] = 0.0
    x[1, 0] = 448.0 * 2.0**-5
    x[2, 40] = math.nextafter(448.0, math.inf)
    x[3, 100] = math.nan
    got = fp8_linear_triton(x, w, s, block_m=16, block_n=32)
    assert torch.isnan(got[3]).all()
    keep = torch.arange(16) != 3
    assert_fp32_close(got[keep], x[keep], w, s)


@interpreted
def test_public_op_dispatches_to_triton(seed, monkeypatch):
    from kernels.triton import fp8_gemm as triton_module

    calls = []
    real = triton_module.fp8_linear_triton

    def spy(*args, **kwargs):
        calls.append("fp8_linear_triton")
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_module, "fp8_linear_triton", spy)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    g = torch.Generator().manual_seed(seed)
    w, s = random_packed(g, 32, 32)
    x = activations(g, 2, 32, torch.float32)
    assert_fp32_close(fp8_linear(x, w, s), x, w, s)
    assert calls == ["fp8_linear_triton"]
    fp8_linear(x.double(), w, s)  # float64 stays on the PyTorch path
    assert calls == ["fp8_linear_triton"]


@pytest.mark.skipif(INTERPRETED, reason="compiles the real kernel; the child interprets it")
def test_kernel_compiles_for_hopper():
    """Types, layouts and shared memory, which the interpreter skips, checked by ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    from kernels.triton.fp8_gemm import _fp8_gemm_kernel

    pointers = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*bf16"}
    constexprs = {"BLOCK_M": 16, "BLOCK_N": 64}
    signature = {name: pointers.get(name, "i32") for name in _fp8_gemm_kernel.arg_names}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = ASTSource(fn=_fp8_gemm_kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": 4, "enable_fp_fusion": False}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm.get("cubin")
    assert compiled.metadata.shared <= 227 * 1024
