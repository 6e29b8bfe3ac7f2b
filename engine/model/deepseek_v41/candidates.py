"""Which compressed entries a query may read (docs/design/architecture.md §1.4, §1.7).

Pure functions over a dense score matrix [T, S] (T queries, S entries):
visibility, the per-query top-k, and the candidate-block filter that the
candidate source layer publishes for the reindex layers after it.

Ordering rules (the spec is silent; kernels must match them):
- a higher score wins; equal scores go to the lower entry (or block) index;
- ``select_topk`` returns indices sorted ascending, padded with -1 at the end.
"""

from __future__ import annotations

import torch

from engine.model.precision import upcast


def visible_entries(positions: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """BoolTensor [T, n_entries]: entry j is visible at pos iff ``j < (pos + 1) // ratio``."""
    complete = torch.div(positions + 1, ratio, rounding_mode="floor")
    return torch.arange(n_entries, device=positions.device)[None, :] < complete[:, None]


def _top_mask(scores: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """BoolTensor [T, S]: each row's k best eligible columns (all of them if fewer).

    Higher score first, equal scores to the lower index; an eligible column
    scoring -inf still outranks every ineligible one. One ``topk`` for the k-th
    value, then a linear pass: no full sort, so it stays cheap at 1M entries.
    """
    k = min(k, scores.shape[1])
    if k == 0:
        return torch.zeros_like(eligible)
    masked = scores.masked_fill(~eligible, float("-inf"))
    kth = torch.topk(masked, k, dim=-1).values[:, -1:]
    above = (masked > kth) & eligible
    tied = (masked == kth) & eligible
    room = k - above.sum(dim=-1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def select_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """LongTensor [T, k]: the k best visible entries per row, ascending, -1 padded.

    With fewer than k visible entries every visible one is taken.
    """
    return mask_columns(_top_mask(upcast(scores), visible, k), k)


def mask_columns(mask: torch.Tensor, width: int) -> torch.Tensor:
    """LongTensor [T, width]: the True columns of each row of ``mask``, ascending, -1 padded.

    Each row must hold at most ``width`` True columns.
    """
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: columns ascend within a row
    rank = mask.cumsum(dim=-1)[rows, cols] - 1
    idx = torch.full((mask.shape[0], width), -1, dtype=torch.long, device=mask.device)
    idx[rows, rank] = cols
    return idx


def select_topk_among(scores: torch.Tensor, entries: torch.Tensor, k: int) -> torch.Tensor:
    """``select_topk`` over a compact list: ``entries`` [T, K] (ascending, -1 padded) and
    their ``scores`` [T, K] -> the k best entries' ids [T, k], ascending, -1 padded.

    The same picks as ``select_topk`` over the dense row with only these entries
    allowed: the list is ascending, so a tie still goes to the lower entry.
    """
    local = select_topk(scores, entries >= 0, k)
    return torch.where(local >= 0, entries.gather(1, local.clamp(min=0)), -1)


def candidate_block_mask(
    scores: torch.Tensor, visible: torch.Tensor, block_size: int, topk_blocks: int
) -> torch.Tensor:
    """BoolTensor [T, S]: visible entries inside each query's top ``topk_blocks`` blocks.

    Block b covers entries ``[b * block_size, (b + 1) * block_size)``; its score
    is the max over its visible entries. The block holding the newest visible
    entry scores +inf (always kept); blocks with no visible entry are never kept.
    When the visible entries span at most ``topk_blocks`` blocks (e.g. a prefix
    of at most ``topk_blocks * block_size`` entries) the result equals ``visible``.
    """
    t, s = scores.shape
    n_blocks = -(-s // block_size)
    pad = n_blocks * block_size - s
    masked = upcast(scores).masked_fill(~visible, float("-inf"))
    masked = torch.nn.functional.pad(masked, (0, pad), value=float("-inf"))
    vis = torch.nn.functional.pad(visible, (0, pad), value=False)
    block_score = masked.view(t, n_blocks, block_size).amax(dim=-1)
    block_visible = vis.view(t, n_blocks, block_size).any(dim=-1)
    # Newest visible entry: the highest visible index (rows with none have no such block).
    cols = torch.arange(n_blocks * block_size, device=scores.device)
    newest = torch.where(vis, cols, -1).amax(dim=-1)
    has_any = newest >= 0
    newest_block = torch.where(has_any, newest // block_size, 0)
    forced = torch.zeros_like(block_visible)
    forced[torch.arange(t), newest_block] = has_any
    block_score = block_score.masked_fill(forced, float("inf"))
    keep_block = _top_mask(block_score, block_visible, topk_blocks)
    keep = keep_block.repeat_interleave(block_size, dim=1)[:, :s]
    return keep & visible
