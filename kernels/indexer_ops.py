"""Lightning-indexer scoring over paged MXFP4 index keys, and the block max for candidates.

docs/design/architecture.md §1.7: ``I[t, s] = sum_h w[t, h] * relu(qi[t, h] . k[s])`` over the
entries s visible to row t; the candidate source then ranks blocks of
``candidate_block_size`` entries by their best score. Top-k and the candidate
rules stay in ``engine.model.deepseek_v41.candidates``.

Each public op runs the Triton kernel or the PyTorch reference (``kernels.dispatch``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_index_keys
from kernels.dispatch import use_triton
from kernels.kv_cache_ops import is_raw_bf16, read_index, read_index_pages

# Reference work sizes: bound the [rows, heads, columns] fp32 dot products.
_REFERENCE_ROWS = 64
_REFERENCE_COLS = 4096
# Index keys per block on the C decode path: 4,096 x 512 B = 2 MB of fp32 keys.
_CPU_BLOCK_KEYS = 4096


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
    if use_triton(qi, index_data, op="indexer_scores") and not is_raw_bf16(index_scales):
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
    tables, inverse, counts = torch.unique(
        block_tables, dim=0, return_inverse=True, return_counts=True
    )
    alone = counts[inverse] == 1
    if bool(alone.any()):
        # Rows alone on their table (decode rows): one batched pass over all of them.
        rows = alone.nonzero().squeeze(1)
        _score_rows_batched(out, rows, qi, w, index_data, index_scales, block_tables, n_visible)
    if bool(alone.all()):
        return out
    # Rows of one sequence share a block table (a prefill chunk): dequantise its keys once.
    for u in (counts > 1).nonzero().squeeze(1).tolist():
        rows = (inverse == u).nonzero().squeeze(1)
        n = int(n_visible[rows].max())
        step = max(1, _REFERENCE_COLS // entries_per_page) * entries_per_page
        for c0 in range(0, n, step):
            c1 = min(c0 + step, n)
            page_ids = tables[u, c0 // entries_per_page : -(-c1 // entries_per_page)]
            k = read_index_pages(index_data, index_scales, page_ids).flatten(0, 1)[: c1 - c0]
            cols = torch.arange(c0, c1, device=qi.device)
            for r0 in range(0, rows.numel(), _REFERENCE_ROWS):
                r = rows[r0 : r0 + _REFERENCE_ROWS]
                dots = torch.einsum("thd,sd->ths", qi[r].to(dt), k.to(dt))
                scores = (dots.relu() * w[r].to(dt)[:, :, None]).sum(dim=1)
                hidden = cols[None, :] >= n_visible[r][:, None]
                out[r, c0:c1] = scores.masked_fill(hidden, float("-inf"))
    return out


def _score_rows_batched(
    out: torch.Tensor,
    rows: torch.Tensor,
    qi: torch.Tensor,
    w: torch.Tensor,
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    block_tables: torch.Tensor,
    n_visible: torch.Tensor,
) -> None:
    """Scores of ``rows`` (each with its own table) in blocks of whole pages.

    Rows go longest first, so a block only holds the rows that still see entries
    in it: ragged contexts cost what they read (within a block per row), and a
    block's dequantised keys are bounded by the work budget, whatever the context.
    """
    dt = out.dtype
    E = index_data.shape[1]
    n = n_visible[rows]
    order = torch.argsort(n, descending=True, stable=True)
    rows = rows[order]
    lengths: list[int] = n[order].tolist()
    if cpu_index_keys.usable(index_data, index_scales, block_tables):
        _score_rows_c(out, rows, lengths, qi, w, index_data, index_scales, block_tables)
        return
    budget = max(1, _REFERENCE_ROWS * _REFERENCE_COLS // 4)  # entries of keys per block
    p, n_pages = 0, -(-lengths[0] // E)
    while p < n_pages:
        active = sum(1 for m in lengths if m > p * E)  # rows sorted: a prefix
        span = max(1, min(budget // (active * E), n_pages - p))
        r = rows[:active]
        k = read_index_pages(index_data, index_scales, block_tables[r, p : p + span])
        k = k.flatten(1, 2).to(dt)  # [active, span * E, 128]
        dots = torch.einsum("thd,tsd->ths", qi[r].to(dt), k)
        scores = (dots.relu() * w[r].to(dt)[:, :, None]).sum(dim=1)
        c0, c1 = p * E, min((p + span) * E, out.shape[1])
        cols = torch.arange(c0, c1, device=out.device)
        hidden = cols[None, :] >= n_visible[r][:, None]
        out[r, c0:c1] = scores[:, : c1 - c0].masked_fill(hidden, float("-inf"))
        p += span


def _score_rows_c(
    out: torch.Tensor,
    rows: torch.Tensor,
    lengths: list[int],
    qi: torch.Tensor,
    w: torch.Tensor,
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    """``_score_rows_batched`` on the C decode path (rows sorted longest first).

    Each block of at most ``_CPU_BLOCK_KEYS`` keys is decoded into one reused
    buffer that stays in cache, so the GEMM reads keys from cache rather than a
    fresh context-sized tensor from DRAM; the per-row operands are gathered once
    per call, not per block. Every score column is its own dot product, so the
    blocking changes no value: the same scores as the eager path (tested).
    """
    dt = out.dtype
    E = index_data.shape[1]
    budget = max(E, _CPU_BLOCK_KEYS // E * E)
    scratch = torch.empty(budget * 128, dtype=torch.float32, device=out.device)
    q = qi[rows].to(dt)
    wr = w[rows].to(dt)[:, :, None]
    tables = block_tables[rows]
    if int(tables.min()) < 0 or int(tables.max()) >= index_data.shape[0]:
        raise IndexError(f"page id out of range [0, {index_data.shape[0]})")  # checked once
    sorted_out = torch.full((rows.numel(), out.shape[1]), float("-inf"), dtype=dt)
    p, n_pages = 0, -(-lengths[0] // E)
    while p < n_pages:
        active = sum(1 for m in lengths if m > p * E)  # rows sorted: a prefix
        span = max(1, min(budget // (active * E), n_pages - p))
        k = cpu_index_keys.read_index_pages(
            index_data, index_scales, tables[:active, p : p + span], scratch, check=False
        )
        k = k.view(active, span * E, 128).to(dt)
        scores = (torch.bmm(q[:active], k.transpose(1, 2)).relu_() * wr[:active]).sum(dim=1)
        c0, c1 = p * E, min((p + span) * E, out.shape[1])
        sorted_out[:active, c0:c1] = scores[:, : c1 - c0]
        p += span
    # Columns past each row's visible count: -inf, as the eager path masks them.
    cols = torch.arange(out.shape[1], device=out.device)
    hidden = cols[None, :] >= torch.tensor(lengths, device=out.device)[:, None]
    out[rows] = sorted_out.masked_fill_(hidden, float("-inf"))


def indexer_scores_at(
    qi: torch.Tensor,
    w: torch.Tensor,
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    block_tables: torch.Tensor,
    entries: torch.Tensor,
) -> torch.Tensor:
    """``[T, K]``: row t's score of entry ``entries[t, j]`` (``-inf`` where it is -1).

    The scores of a few listed entries per row (a Reindex layer's candidates),
    reading only their keys: the work is ``T x K``, whatever the context.
    Same formula and dtype as ``indexer_scores``. PyTorch ops on any device
    (K is small; no Triton kernel needed).
    """
    dt = torch.promote_types(qi.dtype, torch.float32)
    if entries.numel() == 0:
        return torch.full(entries.shape, float("-inf"), dtype=dt, device=qi.device)
    E = index_data.shape[1]
    j = entries.clamp(min=0)
    pages = block_tables.gather(1, torch.div(j, E, rounding_mode="floor"))
    k = read_index(index_data, index_scales, pages, j % E).to(dt)  # [T, K, 128]
    dots = torch.einsum("thd,tkd->thk", qi.to(dt), k)
    scores = (dots.relu() * w.to(dt)[:, :, None]).sum(dim=1)
    return scores.masked_fill(entries < 0, float("-inf"))


def block_max(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[T, ceil(S / block_size)]``: the max of each block of ``block_size`` columns.

    The last block is padded with ``-inf``; the result keeps ``scores``' dtype.
    """
    if use_triton(scores, op="block_max"):
        from kernels.triton.block_max import block_max_triton

        return block_max_triton(scores, block_size)
    return block_max_reference(scores, block_size)


def block_max_reference(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    t, s = scores.shape
    n_blocks = -(-s // block_size)
    padded = F.pad(scores, (0, n_blocks * block_size - s), value=float("-inf"))
    return padded.view(t, n_blocks, block_size).amax(dim=-1)
