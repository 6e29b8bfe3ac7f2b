"""Sparse MQA decode/prefill attention over SWA keys and paged FP4 global entries.

Grid: (query row, block of BLOCK_H heads, split). The heads of a row share
one key set (MQA), so a program loads each key once for BLOCK_H heads and
runs both products on the tensor cores. A split covers a contiguous range of
the row's key list ``[SWA window (Wn) | selected entries (K)]``: first its SWA
part, then its global part, whose 288-byte FP4 records are dequantised in
registers. Each 512-d vector is handled as its even and odd halves, matching
the packed byte layout (byte i = elements 2i, 2i + 1), so no shuffle is needed:
``q.k = q_even.k_even + q_odd.k_odd``.

With one split the program applies the sink and writes the output; with more
(few rows, long key lists: split-K), each writes an unnormalised partial
(acc, max, sum) and ``_combine_kernel`` merges them with the sink by
log-sum-exp. Maths in fp32 (loads are widened); the products use tf32 when q
is 16-bit, which is exact for bf16 queries and FP4 / FP8-derived keys.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton.formats import e2m1_value, e4m3_value

LOG2E = math.log2(math.e)
_NO_KEY = tl.constexpr(
    -1.0e30
)  # running max before any key: finite, so exp2 of differences never sees inf - inf


@triton.jit
def _attend(
    q_lo, q_hi, k_lo, k_hi, valid, m_i, l_i, acc_lo, acc_hi, qk_scale, PRECISION: tl.constexpr
):
    """One online-softmax step of BLOCK_H heads over BLOCK_N keys (log2 domain)."""
    qk = tl.dot(q_lo, tl.trans(k_lo), input_precision=PRECISION)
    qk = tl.dot(q_hi, tl.trans(k_hi), acc=qk, input_precision=PRECISION)
    qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc_lo = tl.dot(p, k_lo, acc=acc_lo * alpha[:, None], input_precision=PRECISION)
    acc_hi = tl.dot(p, k_hi, acc=acc_hi * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc_lo, acc_hi


@triton.jit
def _sparse_attention_kernel(
    q_ptr,
    q_st,
    q_sh,
    swa_ptr,
    swa_st,
    swa_sw,
    valid_ptr,
    valid_st,
    md_ptr,
    md_sp,
    md_se,
    ms_ptr,
    ms_sp,
    ms_se,
    bt_ptr,
    bt_st,
    idx_ptr,
    idx_st,
    sink_ptr,
    out_ptr,
    out_st,
    out_sh,
    part_ptr,
    ml_ptr,
    T,
    H,
    Wn,
    K,
    E,
    chunk,
    qk_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hmask = heads < H
    d = tl.arange(0, 256)

    q_rows = q_ptr + t * q_st + heads[:, None] * q_sh + 2 * d[None, :]
    q_lo = tl.load(q_rows, mask=hmask[:, None], other=0.0).to(tl.float32)
    q_hi = tl.load(q_rows + 1, mask=hmask[:, None], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_H], _NO_KEY, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_lo = tl.zeros([BLOCK_H, 256], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, 256], tl.float32)

    start = split * chunk
    stop = tl.minimum(start + chunk, Wn + K)

    # SWA keys [start, min(stop, Wn)): already floats; invalid ones are never loaded.
    swa_stop = tl.minimum(stop, Wn)
    for n0 in range(start, swa_stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = tl.load(valid_ptr + t * valid_st + n, mask=n < swa_stop, other=0) != 0
        rows = swa_ptr + t * swa_st + n[:, None] * swa_sw + 2 * d[None, :]
        k_lo = tl.load(rows, mask=valid[:, None], other=0.0).to(tl.float32)
        k_hi = tl.load(rows + 1, mask=valid[:, None], other=0.0).to(tl.float32)
        m_i, l_i, acc_lo, acc_hi = _attend(
            q_lo, q_hi, k_lo, k_hi, valid, m_i, l_i, acc_lo, acc_hi, qk_scale, PRECISION
        )

    # Global entries [max(start, Wn) - Wn, stop - Wn) of the selection: FP4 records.
    g_start = tl.maximum(start, Wn) - Wn
    g_stop = stop - Wn
    for n0 in range(g_start, g_stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        j = tl.load(idx_ptr + t * idx_st + n, mask=n < g_stop, other=-1)
        valid = j >= 0
        j = tl.maximum(j, 0)
        page = tl.load(bt_ptr + t * bt_st + j // E, mask=valid, other=0).to(tl.int64)
        slot = j % E
        rec = page[:, None] * md_sp + slot[:, None] * md_se + d[None, :]
        b = tl.load(md_ptr + rec, mask=valid[:, None], other=0).to(tl.int32)
        srec = page[:, None] * ms_sp + slot[:, None] * ms_se + d[None, :] // 8
        scale = e4m3_value(tl.load(ms_ptr + srec, mask=valid[:, None], other=0).to(tl.int32))
        k_lo = e2m1_value(b & 15) * scale
        k_hi = e2m1_value(b >> 4) * scale
        m_i, l_i, acc_lo, acc_hi = _attend(
            q_lo, q_hi, k_lo, k_hi, valid, m_i, l_i, acc_lo, acc_hi, qk_scale, PRECISION
        )

    if SPLIT:
        row = (split * T + t) * H + heads
        part = part_ptr + row[:, None] * 512 + 2 * d[None, :]
        tl.store(part, acc_lo, mask=hmask[:, None])
        tl.store(part + 1, acc_hi, mask=hmask[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=hmask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=hmask)
    else:
        # The sink joins the softmax denominator only; its column is dropped.
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        w = alpha / (l_i * alpha + tl.exp2(sink - m_f))
        o = out_ptr + t * out_st + heads[:, None] * out_sh + 2 * d[None, :]
        tl.store(o, (acc_lo * w[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
        tl.store(o + 1, (acc_hi * w[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _combine_kernel(
    part_ptr,
    ml_ptr,
    sink_ptr,
    out_ptr,
    out_st,
    out_sh,
    T,
    H,
    num_splits,
    BLOCK_H: tl.constexpr,
):
    """Merge the splits' (acc, max, sum) of one row and head block with the sink."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, 256)
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = sink
    for s in range(num_splits):
        row = (s * T + t) * H + heads
        m_f = tl.maximum(m_f, tl.load(ml_ptr + row * 2, mask=hmask, other=_NO_KEY))
    denom = tl.exp2(sink - m_f)
    acc_lo = tl.zeros([BLOCK_H, 256], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, 256], tl.float32)
    for s in range(num_splits):
        row = (s * T + t) * H + heads
        a = tl.exp2(tl.load(ml_ptr + row * 2, mask=hmask, other=_NO_KEY) - m_f)
        denom += tl.load(ml_ptr + row * 2 + 1, mask=hmask, other=0.0) * a
        part = part_ptr + row[:, None] * 512 + 2 * d[None, :]
        acc_lo += tl.load(part, mask=hmask[:, None], other=0.0) * a[:, None]
        acc_hi += tl.load(part + 1, mask=hmask[:, None], other=0.0) * a[:, None]
    o = out_ptr + t * out_st + heads[:, None] * out_sh + 2 * d[None, :]
    tl.store(o, (acc_lo / denom[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])
    tl.store(o + 1, (acc_hi / denom[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None])


def default_num_splits(rows: int, head_blocks: int, n_keys: int, device: torch.device) -> int:
    """Split-K only when rows x head blocks leave the GPU's SMs idle and the key list is long."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = rows * head_blocks
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(n_keys, 256)))


def sparse_attention_triton(
    q: torch.Tensor,
    swa_k: torch.Tensor,
    swa_valid: torch.Tensor,
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    block_tables: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_h: int = 16,
    block_n: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    """Triton ``sparse_attention`` (same contract).

    ``out`` (q's shape and dtype, contiguous) may be given; ``num_splits``
    forces the split-K count (default: ``default_num_splits``); ``block_h`` /
    ``block_n`` / ``num_warps`` are tuning knobs (block_h, block_n >= 16).
    """
    t, h, dim = q.shape
    assert dim == 512, "the kernel is written for the 512-d latent"
    wn, k = swa_k.shape[1], topk_idx.shape[1]
    assert swa_k.shape == (t, wn, 512) and swa_valid.shape == (t, wn), (
        swa_k.shape,
        swa_valid.shape,
    )
    assert topk_idx.shape == (t, k) and block_tables.shape[0] == t and sink.shape == (h,)
    assert main_data.shape[2] == 256 and main_scales.shape[2] == 32
    assert main_data.stride(2) == 1 and main_scales.stride(2) == 1
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    if t == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    swa_k = swa_k if swa_k.stride(2) == 1 else swa_k.contiguous()
    valid = swa_valid.contiguous().view(torch.uint8)
    block_tables = block_tables.contiguous()
    topk_idx = topk_idx.contiguous()
    sink = sink.contiguous()

    head_blocks = triton.cdiv(h, block_h)
    n_keys = wn + k
    if num_splits is None:
        num_splits = default_num_splits(t, head_blocks, n_keys, q.device)
    chunk = triton.cdiv(triton.cdiv(max(n_keys, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(n_keys, chunk))
    split = num_splits > 1
    if split:
        part = torch.empty(num_splits, t, h, 512, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_splits, t, h, 2, dtype=torch.float32, device=q.device)
    else:
        part = ml = out  # unused by the kernel when SPLIT is false
    precision = "tf32" if q.dtype in (torch.bfloat16, torch.float16) else "ieee"
    _sparse_attention_kernel[(t, head_blocks, num_splits)](
        q,
        q.stride(0),
        q.stride(1),
        swa_k,
        swa_k.stride(0),
        swa_k.stride(1),
        valid,
        valid.stride(0),
        main_data,
        main_data.stride(0),
        main_data.stride(1),
        main_scales,
        main_scales.stride(0),
        main_scales.stride(1),
        block_tables,
        block_tables.stride(0),
        topk_idx,
        topk_idx.stride(0),
        sink,
        out,
        out.stride(0),
        out.stride(1),
        part,
        ml,
        t,
        h,
        wn,
        k,
        main_data.shape[1],
        chunk,
        scale * LOG2E,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        SPLIT=split,
        PRECISION=precision,
        num_warps=num_warps,
        enable_fp_fusion=True,  # fma in the online softmax; compared with a tolerance
    )
    if split:
        _combine_kernel[(t, head_blocks)](
            part,
            ml,
            sink,
            out,
            out.stride(0),
            out.stride(1),
            t,
            h,
            num_splits,
            BLOCK_H=block_h,
            num_warps=num_warps,
            enable_fp_fusion=True,
        )
    return out
