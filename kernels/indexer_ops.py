"""Lightning-indexer scoring over paged MXFP4 index keys, and the block max for candidates.

docs/design/architecture.md §1.7: ``I[t, s] = sum_h w[t, h] * relu(qi[t, h] . k[s])`` over the
entries s visible to row t; the candidate source then ranks blocks of
``candidate_block_size`` entries by their best score. Top-k and the candidate
rules stay in ``engine.model.candidates``.

Each public op runs the Triton kernel or the PyTorch reference (``kernels.dispatch``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import use_triton
from kernels.kv_cache_ops import is_raw_bf16, locate, read_index

# Reference work sizes: bound the [rows, heads, columns] fp32 dot products.
_REFERENCE_ROWS = 64
_REFERENCE_COLS = 4096


def indexer_scores(
    qi: torch.Tensor,
    w: torch.Tensor,
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    block_tables: torch.Tensor,
    n_visible: torch.Tensor,
    n_cols: int,
) -> torch.Tensor:
    """``[T, n_cols]``: row t's score of entry s, ``-inf`` for ``s >= n_visible[t]``.

    float32 (float64 for float64 queries: the engine's float64 test mode).

    qi ``[T, h, 128]``, w ``[T, h]``, index_data / index_scales the kv source's
    index-key page views, block_tables ``Long[T, max_pages]`` (each row's
    sequence, padded with 0), n_visible ``Long[T]``.
    """
    if use_triton(qi, index_data) and not is_raw_bf16(index_scales):
        from kernels.triton.indexer_scores import indexer_scores_triton

        return indexer_scores_triton(
            qi, w, index_data, index_scales, block_tables, n_visible, n_cols
        )
    return indexer_scores_reference(
        qi, w, index_data, index_scales, block_tables, n_visible, n_cols
    )


def indexer_scores_reference(
    qi: torch.Tensor,
    w: torch.Tensor,
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    block_tables: torch.Tensor,
    n_visible: torch.Tensor,
    n_cols: int,
) -> torch.Tensor:
    # fp32, or float64 for float64 queries (the engine's float64 test mode).
    dt = torch.promote_types(qi.dtype, torch.float32)
    out = torch.full((qi.shape[0], n_cols), float("-inf"), dtype=dt, device=qi.device)
    if qi.shape[0] == 0 or n_cols == 0 or block_tables.shape[1] == 0:
        return out  # nothing can be visible
    entries_per_page = index_data.shape[1]
    n_visible = n_visible.clamp(max=min(n_cols, block_tables.shape[1] * entries_per_page))
    # Rows of one sequence share a block table: dequantise its keys once.
    tables, inverse = torch.unique(block_tables, dim=0, return_inverse=True)
    for u in range(tables.shape[0]):
        rows = (inverse == u).nonzero().squeeze(1)
        n = int(n_visible[rows].max())
        for c0 in range(0, n, _REFERENCE_COLS):
            cols = torch.arange(c0, min(c0 + _REFERENCE_COLS, n), device=qi.device)
            pages, slots = locate(tables[u], cols, entries_per_page)
            k = read_index(index_data, index_scales, pages, slots)
            for r0 in range(0, rows.numel(), _REFERENCE_ROWS):
                r = rows[r0 : r0 + _REFERENCE_ROWS]
                dots = torch.einsum("thd,sd->ths", qi[r].to(dt), k.to(dt))
                scores = (dots.relu() * w[r].to(dt)[:, :, None]).sum(dim=1)
                hidden = cols[None, :] >= n_visible[r][:, None]
                out[r[:, None], cols[None, :]] = scores.masked_fill(hidden, float("-inf"))
    return out


def block_max(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[T, ceil(S / block_size)]``: the max of each block of ``block_size`` columns.

    The last block is padded with ``-inf``; the result keeps ``scores``' dtype.
    """
    if use_triton(scores):
        from kernels.triton.block_max import block_max_triton

        return block_max_triton(scores, block_size)
    return block_max_reference(scores, block_size)


def block_max_reference(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    t, s = scores.shape
    n_blocks = -(-s // block_size)
    padded = F.pad(scores, (0, n_blocks * block_size - s), value=float("-inf"))
    return padded.view(t, n_blocks, block_size).amax(dim=-1)
