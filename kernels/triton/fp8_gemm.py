"""Block-FP8 linear: ``y = quant(x) W^T`` with W as E4M3 bytes and E8M0 32 x 32 block scales.

Grid: (block of BLOCK_M rows of x, block of BLOCK_N output columns). A program
walks K in blocks of 32: it loads the x tile in the model dtype, quantises it
per row to E4M3 with a power-of-two scale (``kernels.act_quant``'s rule, the
exponent read from the amax's bits), decodes the weight bytes and their scales
exactly (``formats``), takes the tile product (E4M3 x E4M3 products are exact
in tf32 with fp32 accumulation), scales it by the row's activation scale and
each column's weight-block scale, and adds it to an fp32 accumulator. The
result is stored in the output's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.formats import e4m3_round_positive, e4m3_value, e8m0_value, pow2


@triton.jit
def act_exponent(amax):
    """``ceil(log2(max(amax, 1e-4) / 448))`` exactly; inf gives 127.

    With a = 1.f * 2^E: a / 448 = (1.f / 1.75) * 2^(E - 8), so e = E - 8, plus
    one when 1.f > 1.75 (mantissa bits above 0x600000).
    """
    a = tl.maximum(amax, 1e-4)
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 255) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(a == float("inf"), 127, e)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    x_st,
    w_ptr,
    w_st,
    s_ptr,
    s_st,
    out_ptr,
    out_st,
    M,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    kk = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_st
    w_rows = w_ptr + cols.to(tl.int64)[None, :] * w_st
    s_rows = s_ptr + (cols // 32).to(tl.int64) * s_st
    for kb in range(0, K // 32):
        k = kb * 32 + kk
        x = tl.load(x_rows + k[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
        # The block's amax ignores NaN (which then quantises to NaN on its own).
        amax = tl.max(tl.where(x == x, tl.abs(x), 0.0), 1)
        e = act_exponent(amax)
        v = x * pow2(-e)[:, None]  # exact: a power of two
        mag = e4m3_round_positive(tl.minimum(tl.abs(v), 448.0))
        q = tl.where(v < 0, -mag, mag)
        q = tl.where(v == v, q, float("nan"))
        b = tl.load(w_rows + k[:, None], mask=cmask[None, :], other=0).to(tl.int32) & 255
        w = e4m3_value(b)  # [32, BLOCK_N]
        ws = e8m0_value(tl.load(s_rows + kb, mask=cmask, other=127).to(tl.int32) & 255)
        part = tl.dot(q, w, input_precision="tf32")
        acc += part * pow2(e)[:, None] * ws[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * out_st + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton ``fp8_linear`` (same contract); ``out`` (``[M, N]`` in x's dtype) may be given."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.dtype == x.dtype and out.stride(1) == 1
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    w = weight.view(torch.uint8)
    s = scale.view(torch.uint8)
    assert w.stride(1) == 1 and s.stride(1) == 1 and k % 32 == 0
    _fp8_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x2,
        x2.stride(0),
        w,
        w.stride(0),
        s,
        s.stride(0),
        out,
        out.stride(0),
        m,
        n,
        k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    return out.reshape(*lead, n)
