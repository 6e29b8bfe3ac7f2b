"""Sparse MQA with a per-head sink over a row's SWA window and its selected global entries.

docs/design/architecture.md §1.4: query row t (64 heads x 512) attends, with K = V, to the union
of its valid SWA keys and its top-k compressed entries (paged FP4 records of
the layer's kv source). The softmax includes one extra logit ``sink[h]`` whose
column is dropped, so a row with no keys returns zeros. The keys carry RoPE,
so the output does too: the caller applies the inverse RoPE to the last 64
dims (``Attention.project_out``). Same maths as ``engine.model.deepseek_v41.sink_attention``.

The public op runs the Triton kernel or the PyTorch reference (``kernels.dispatch``).
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton
from kernels.kv_cache_ops import is_raw_bf16, read_main

# Rows per step of the reference: bounds its [rows, keys, 512] fp32 key tensor.
_REFERENCE_ROWS = 32


def sparse_attention(
    q: torch.Tensor,
    swa_k: torch.Tensor,
    swa_valid: torch.Tensor,
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    block_tables: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[T, H, 512]`` in q's dtype (fp32 inside; float64 queries stay float64).

    q ``[T, H, 512]``; swa_k ``[T, Wn, 512]`` (the row's dequantised window,
    padded; invalid keys are never read, whatever they hold); swa_valid
    ``Bool[T, Wn]``; main_data / main_scales the kv source's page views;
    block_tables ``Long[T, max_pages]`` (each row's sequence, padded with 0);
    topk_idx ``Long[T, K]`` (-1 padded, K may be 0); sink ``[H]``; logits are
    ``q.k * scale``.
    """
    if use_triton(q, main_data, op="sparse_attention") and not is_raw_bf16(main_scales):
        from kernels.triton.sparse_attention import sparse_attention_triton

        return sparse_attention_triton(
            q, swa_k, swa_valid, main_data, main_scales, block_tables, topk_idx, sink, scale
        )
    return sparse_attention_reference(
        q, swa_k, swa_valid, main_data, main_scales, block_tables, topk_idx, sink, scale
    )


def sparse_attention_reference(
    q: torch.Tensor,
    swa_k: torch.Tensor,
    swa_valid: torch.Tensor,
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    block_tables: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    for r0 in range(0, q.shape[0], _REFERENCE_ROWS):
        rows = slice(r0, r0 + _REFERENCE_ROWS)
        out[rows] = _attend_rows(
            q[rows],
            swa_k[rows],
            swa_valid[rows],
            main_data,
            main_scales,
            block_tables[rows],
            topk_idx[rows],
            sink,
            scale,
        )
    return out


def _attend_rows(
    q: torch.Tensor,
    swa_k: torch.Tensor,
    swa_valid: torch.Tensor,
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    block_tables: torch.Tensor,
    topk_idx: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    # Global keys of each row: its selected entries located through its own block table.
    entries_per_page = main_data.shape[1]
    j = topk_idx.clamp(min=0)
    pages = block_tables.gather(1, torch.div(j, entries_per_page, rounding_mode="floor"))
    slots = j % entries_per_page
    glob = read_main(main_data, main_scales, pages, slots)
    # fp32, or float64 for float64 queries (the engine's float64 test mode).
    dt = torch.promote_types(q.dtype, torch.float32)
    keys = torch.cat((swa_k.to(dt), glob.to(dt)), dim=1)  # [t, Wn + K, 512]
    valid = torch.cat((swa_valid, topk_idx >= 0), dim=1)
    # Zero what is not a key, so padding (even NaN) never reaches the output.
    keys = keys.masked_fill(~valid[..., None], 0.0)
    logits = torch.einsum("thd,tsd->ths", q.to(dt), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_col = sink.to(dt)[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat((logits, sink_col), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("ths,tsd->thd", probs, keys).to(q.dtype)
