"""KV compressor of the kv source layers (docs/design/architecture.md §1.6).

Ratio 2 pools each pair of tokens (2j, 2j+1) with a per-channel softmax gate;
ratio 1 only normalises. Entry j is un-RoPE'd here: the caller ropes it at the
group's first position ``j * r`` (``entry_positions``) and quantises it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.norm import RMSNorm
from engine.model.precision import upcast


def entry_positions(n_entries: int, ratio: int, start_entry: int = 0) -> torch.Tensor:
    """RoPE position of entries ``start_entry ..``: entry j sits at its group start ``j * r``."""
    return torch.arange(start_entry, start_entry + n_entries, dtype=torch.long) * ratio


class Compressor(nn.Module):
    """``attn.compressor`` of a kv source: ``wkv``, ``wgate`` (ratio 2 only), ``norm``."""

    entry_positions = staticmethod(entry_positions)

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        ratio = config.compress_ratios[layer_id]
        if ratio not in (1, 2):
            raise ValueError(f"layer {layer_id}: compressor needs ratio 1 or 2, got {ratio}")
        self.ratio = ratio
        self.head_dim = config.head_dim
        self.wkv = nn.Linear(config.hidden_size, config.head_dim, bias=False)
        # Ratio 1 pools a single token: the checkpoint carries no gate.
        self.wgate = (
            nn.Linear(config.hidden_size, config.head_dim, bias=False) if ratio == 2 else None
        )
        self.norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Raw rows ``[a | g]`` (ratio 2, [T, 2 * head_dim]) or ``a`` (ratio 1), always fp32.

        fp32 because the open group's row is kept as per-request state between
        steps (docs/design/architecture.md §1.10, "Compressor state").
        """
        x32 = upcast(x)
        a = F.linear(x32, upcast(self.wkv.weight))
        if self.wgate is None:
            return a
        return torch.cat((a, F.linear(x32, upcast(self.wgate.weight))), dim=-1)

    def combine(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Latents [k, head_dim] in ``dtype`` from ``k * ratio`` consecutive complete-group rows.

        The pooling runs in fp32; its result is rounded to the model's dtype
        before the norm, where the release rounds it.
        """
        assert rows.shape[0] % self.ratio == 0, (rows.shape, self.ratio)
        rows = upcast(rows)
        if self.ratio == 1:
            return self.norm(rows.to(dtype))
        pairs = rows.view(-1, 2, 2 * self.head_dim)
        a, g = pairs[..., : self.head_dim], pairs[..., self.head_dim :]
        weights = torch.softmax(g, dim=1)  # per channel, over the two tokens of the group
        return self.norm((weights * a).sum(dim=1).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Latents of the complete groups of ``x`` [T, D] (T // ratio rows, x's dtype).

        ``x`` starts at a multiple of the ratio; a trailing incomplete group is
        pending state, not an entry, so it is dropped here.
        """
        complete = x.shape[0] // self.ratio * self.ratio
        return self.combine(self.project(x[:complete]), x.dtype)
