"""The block-diagonal output projection of attention (``attn.wo_a``).

Its own module because both attention (which runs it) and ``fp8_linear`` (which
swaps it for the packed FP8 version at load) need the class.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.precision import upcast


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group g maps its own input slice to ``out_per_group``.

    ``weight`` is ``[n_groups * out_per_group, in_per_group]``, the checkpoint's
    ``wo_a.weight``: rows ``g * out_per_group ..`` belong to group g (the layout
    vLLM's ``wo_a.weight.view(G, o_lora_rank, -1)`` and transformers'
    ``DeepseekV4GroupedLinear`` read).
    """

    def __init__(self, in_per_group: int, out_per_group: int, n_groups: int) -> None:
        super().__init__()
        self.n_groups = n_groups
        self.out_per_group = out_per_group
        self.weight = nn.Parameter(torch.empty(n_groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n_groups, in_per_group] -> [..., n_groups, out_per_group], fp32."""
        w = upcast(self.weight).view(self.n_groups, self.out_per_group, -1)
        return torch.einsum("...gi,goi->...go", upcast(x), w)
