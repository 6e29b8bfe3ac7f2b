"""An image's span in the prompt: which position takes which vector.

Every position of the span carries the placeholder id; what the language model
sees there is, in order: ``image_start``; per row of image tokens, that row's
aligner rows left to right and ``image_newline``; ``image_end``.
"""

from __future__ import annotations

from enum import IntEnum

import torch


class SpanRole(IntEnum):
    START = 0
    CELL = 1
    NEWLINE = 2
    END = 3


def span_roles(n_llm_h: int, n_llm_w: int) -> torch.Tensor:
    """LongTensor [n_h * (n_w + 1) + 2] of ``SpanRole`` values, in reading order."""
    row = [SpanRole.CELL] * n_llm_w + [SpanRole.NEWLINE]
    return torch.tensor([SpanRole.START, *row * n_llm_h, SpanRole.END], dtype=torch.long)


def span_rows(
    cells: torch.Tensor,
    n_llm_h: int,
    n_llm_w: int,
    start: torch.Tensor,
    newline: torch.Tensor,
    end: torch.Tensor,
) -> torch.Tensor:
    """[T, hidden] rows of one span from its aligner ``cells [n_h * n_w, hidden]``."""
    if cells.shape[0] != n_llm_h * n_llm_w:
        raise ValueError(f"{cells.shape[0]} aligner rows for a {n_llm_h}x{n_llm_w} token grid")
    roles = span_roles(n_llm_h, n_llm_w).to(cells.device)
    out = cells.new_empty(roles.shape[0], cells.shape[1])
    out[roles == SpanRole.CELL] = cells
    out[roles == SpanRole.START] = start.to(cells.dtype)
    out[roles == SpanRole.NEWLINE] = newline.to(cells.dtype)
    out[roles == SpanRole.END] = end.to(cells.dtype)
    return out
