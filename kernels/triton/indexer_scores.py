"""Indexer scores over paged MXFP4 keys: ``sum_h w[t,h] * relu(qi[t,h] . k[s])``.

Grid: (query row, block of BLOCK_S entries). A program dequantises its
entries' 68-byte keys in registers (byte i = elements 2i, 2i + 1, exponent
byte ``i // 16``), takes all heads' dot products on the tensor cores as
``q_even.k_even + q_odd.k_odd``, and reduces over heads. Entries at or past
the row's ``n_visible`` are written as ``-inf`` without reading their pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.formats import e2m1_value, e8m0_value


@triton.jit
def _indexer_scores_kernel(
    qi_ptr,
    qi_st,
    qi_sh,
    w_ptr,
    w_st,
    id_ptr,
    id_sp,
    id_se,
    is_ptr,
    is_sp,
    is_se,
    bt_ptr,
    bt_st,
    nvis_ptr,
    out_ptr,
    out_st,
    n_heads,
    n_cols,
    E,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    visible = cols < tl.load(nvis_ptr + t)
    heads = tl.arange(0, BLOCK_HEADS)
    hmask = heads < n_heads
    d = tl.arange(0, 64)

    q_rows = qi_ptr + t * qi_st + heads[:, None] * qi_sh + 2 * d[None, :]
    q_lo = tl.load(q_rows, mask=hmask[:, None], other=0.0).to(tl.float32)
    q_hi = tl.load(q_rows + 1, mask=hmask[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t * w_st + heads, mask=hmask, other=0.0).to(tl.float32)

    c = tl.where(visible, cols, 0)
    page = tl.load(bt_ptr + t * bt_st + c // E, mask=visible, other=0).to(tl.int64)
    slot = c % E
    rec = page[:, None] * id_sp + slot[:, None] * id_se
    b = tl.load(id_ptr + rec + d[None, :], mask=visible[:, None], other=0).to(tl.int32)
    srec = page[:, None] * is_sp + slot[:, None] * is_se + d[None, :] // 16
    scale = e8m0_value(tl.load(is_ptr + srec, mask=visible[:, None], other=127).to(tl.int32))
    k_lo = e2m1_value(b & 15) * scale
    k_hi = e2m1_value(b >> 4) * scale

    dots = tl.dot(q_lo, tl.trans(k_lo), input_precision=PRECISION)
    dots = tl.dot(q_hi, tl.trans(k_hi), acc=dots, input_precision=PRECISION)
    score = tl.sum(tl.maximum(dots, 0.0) * w[:, None], 0)
    score = tl.where(visible, score, float("-inf"))
    tl.store(out_ptr + t * out_st + cols, score, mask=cols < n_cols)


def indexer_scores_triton(
    qi: torch.Tensor,
    w: torch.Tensor,
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    block_tables: torch.Tensor,
    n_visible: torch.Tensor,
    n_cols: int,
    out: torch.Tensor | None = None,
    block_s: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton ``indexer_scores`` (same contract); ``out`` (float32 ``[T, n_cols]``) may be given."""
    t, h, dim = qi.shape
    assert dim == 128 and w.shape == (t, h) and n_visible.shape == (t,)
    assert block_tables.shape[0] == t
    assert index_data.shape[2] == 64 and index_scales.shape[2] == 4
    assert index_data.stride(2) == 1 and index_scales.stride(2) == 1
    if out is None:
        out = torch.empty(t, n_cols, dtype=torch.float32, device=qi.device)
    assert out.shape == (t, n_cols) and out.dtype == torch.float32 and out.stride(1) == 1
    if t == 0 or n_cols == 0:
        return out
    qi = qi if qi.stride(2) == 1 else qi.contiguous()
    # Entries past the block table cannot be visible (the reference clamps the same way).
    n_visible = n_visible.clamp(max=block_tables.shape[1] * index_data.shape[1]).contiguous()
    precision = "tf32" if qi.dtype in (torch.bfloat16, torch.float16) else "ieee"
    _indexer_scores_kernel[(t, triton.cdiv(n_cols, block_s))](
        qi,
        qi.stride(0),
        qi.stride(1),
        w.contiguous(),
        h,
        index_data,
        index_data.stride(0),
        index_data.stride(1),
        index_scales,
        index_scales.stride(0),
        index_scales.stride(1),
        block_tables.contiguous(),
        block_tables.shape[1],
        n_visible,
        out,
        out.stride(0),
        h,
        n_cols,
        index_data.shape[1],
        BLOCK_HEADS=max(16, triton.next_power_of_2(h)),
        BLOCK_S=block_s,
        PRECISION=precision,
        num_warps=num_warps,
        enable_fp_fusion=True,  # fma in the head reduction; compared with a tolerance
    )
    return out
