"""The aligner: ViT features -> image-token rows of the language model.

Checkpoint names under ``aligner.``: ``w1.{weight,bias}`` ``[hidden, vit_dim * r^2]``
and ``w2.{weight,bias}`` ``[hidden, hidden]``. The patch grid is zero-padded on
the right and bottom to multiples of ``r = downsample_ratio``; each ``r x r``
cell, in reading order, becomes one vector channel-major (channel, then the
cell's row, then its column) and goes through ``w2(gelu(w1 x))`` with the exact
(erf) GELU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.deepseek_v41.vision.config import VisionConfig


def merge_cells(features: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """[n_h * n_w, C] -> [ceil(n_h / r) * ceil(n_w / r), C * r * r], channel-major per cell."""
    c = features.shape[-1]
    grid = features.view(n_h, n_w, c)
    grid = F.pad(grid, (0, 0, 0, -n_w % r, 0, -n_h % r))  # zeros right and bottom
    rows, cols = grid.shape[0] // r, grid.shape[1] // r
    cells = grid.view(rows, r, cols, r, c).permute(0, 2, 4, 1, 3)  # [rows, cols, C, r, r]
    return cells.reshape(rows * cols, c * r * r)


class Aligner(nn.Module):
    def __init__(self, vision: VisionConfig, text_hidden: int) -> None:
        super().__init__()
        self.ratio = vision.downsample_ratio
        self.w1 = nn.Linear(vision.hidden_size * self.ratio**2, text_hidden, bias=True)
        self.w2 = nn.Linear(text_hidden, text_hidden, bias=True)

    def forward(self, features: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        x = merge_cells(features, n_h, n_w, self.ratio)
        return self.w2(F.gelu(self.w1(x), approximate="none"))
