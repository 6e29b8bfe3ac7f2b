"""Grouped GEMM over packed MXFP4 experts: one launch for every expert that received rows.

Rows are sorted by expert (``offsets[e]:offsets[e+1]`` belong to expert e).
The grid's first axis walks row tiles of ``BLOCK_M`` rows, each inside one
expert; the tile map (expert, first row, end row per tile) is built on the
device from ``offsets``, so the launch needs no host sync. Its size is an upper
bound, ``min(M, cdiv(M, BLOCK_M) + E)``; tiles past the last return at once.

Per block of 32 along K the kernel decodes the activation's E4M3 bytes and
the weight's E2M1 nibbles to fp16 (both exactly), takes one ``tl.dot`` with
fp32 accumulation (each product of an E4M3 and an E2M1 value is exact in
fp32), and scales the block's partial sums by the activation's and the
weight's power-of-two scales, which is exact too: the result differs from the
fp32 reference only in the order of the fp32 additions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.formats import e2m1_value, e4m3_value, e8m0_value

_K_BLOCK = 32


@triton.jit
def _grouped_mxfp4_kernel(
    a_ptr,
    a_st,
    as_ptr,
    as_st,
    w_ptr,
    w_st_e,
    w_st_n,
    ws_ptr,
    ws_st_e,
    ws_st_n,
    out_ptr,
    out_st,
    tile_expert_ptr,
    tile_row0_ptr,
    tile_row1_ptr,
    N,
    K_BLOCKS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    r0 = tl.load(tile_row0_ptr + tile)
    r1 = tl.load(tile_row1_ptr + tile)
    if r0 >= r1:
        return
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = r0 + tl.arange(0, BLOCK_M)
    row_ok = rows < r1
    rows64 = rows.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    kk = tl.arange(0, 32)
    w_base = w_ptr + e * w_st_e + cols[None, :] * w_st_n + kk[:, None] // 2  # [32, BLOCK_N]
    shift = (kk[:, None] % 2) * 4  # even element in the low nibble
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K_BLOCKS):
        a_bytes = tl.load(
            a_ptr + rows64[:, None] * a_st + g * 32 + kk[None, :], mask=row_ok[:, None], other=0
        ).to(tl.int32)
        a = e4m3_value(a_bytes & 0xFF).to(tl.float16)
        w_bytes = tl.load(w_base + g * 16, mask=col_ok[None, :], other=0).to(tl.int32) & 0xFF
        w = e2m1_value((w_bytes >> shift) & 15).to(tl.float16)
        part = tl.dot(a, w, out_dtype=tl.float32)
        a_s = tl.load(as_ptr + rows64 * as_st + g, mask=row_ok, other=0.0)
        w_s_bytes = tl.load(ws_ptr + e * ws_st_e + cols * ws_st_n + g, mask=col_ok, other=127)
        w_s = e8m0_value(w_s_bytes.to(tl.int32) & 0xFF)
        acc += (part * a_s[:, None]) * w_s[None, :]
    out = out_ptr + rows64[:, None] * out_st + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


def tile_map(
    offsets: torch.Tensor, block_m: int, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, end row) per row tile, Int32[bound], built on ``offsets``' device.

    Unused tiles past the last have first row == end row (the kernel returns at once).
    """
    n_experts = offsets.numel() - 1
    bound = max(1, min(n_rows, triton.cdiv(n_rows, block_m) + n_experts))
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    ids = torch.arange(bound, device=offsets.device)
    expert = torch.searchsorted(tile_end, ids, right=True)
    used = expert < n_experts
    expert = expert.clamp(max=n_experts - 1)
    local = ids - (tile_end - tiles)[expert]
    row0 = offsets[expert] + local * block_m
    row1 = offsets[expert + 1]
    row0 = torch.where(used, row0, torch.zeros_like(row0))
    row1 = torch.where(used, row1, torch.zeros_like(row1))
    return expert.to(torch.int32), row0.to(torch.int32), row1.to(torch.int32)


def grouped_mxfp4_matmul_triton(
    a_values: torch.Tensor,
    a_scales: torch.Tensor,
    offsets: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    block_m: int = 16,
    block_n: int = 64,
) -> torch.Tensor:
    """Triton ``grouped_mxfp4_matmul`` (same contract): fp32 ``[M, N]``."""
    m, k = a_values.shape
    n = w.shape[1]
    out = torch.empty(m, n, dtype=torch.float32, device=a_values.device)
    if m == 0 or n == 0:
        return out
    a = a_values.contiguous().view(torch.uint8)
    a_s = a_scales.float().contiguous()
    wb = w.contiguous().view(torch.uint8)
    ws = w_scale.contiguous().view(torch.uint8)
    expert, row0, row1 = tile_map(offsets.to(a.device), block_m, m)
    grid = (expert.numel(), triton.cdiv(n, block_n))
    _grouped_mxfp4_kernel[grid](
        a,
        a.stride(0),
        a_s,
        a_s.stride(0),
        wb,
        wb.stride(0),
        wb.stride(1),
        ws,
        ws.stride(0),
        ws.stride(1),
        out,
        out.stride(0),
        expert,
        row0,
        row1,
        n,
        k // _K_BLOCK,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        enable_fp_fusion=False,
    )
    return out
