"""Auxiliary-loss-free load balancing of the MoE routers (DeepSeek-V3's noaux_tc rule).

The gate's ``bias`` (e_score_correction_bias) only selects experts. After each
optimizer step it moves by ``rate`` towards balance: up for experts that got
fewer tokens than the mean in that step, down for those that got more.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from engine.model.base import CausalLM


class RouterBalance:
    """Counts routed tokens per expert and layer through forward hooks on every gate."""

    def __init__(self, model: CausalLM, rate: float) -> None:
        self.rate = rate
        self.gates = {block.layer_id: block.ffn.gate for block in model.blocks}
        n = model.config.n_routed_experts
        self.counts = {l: torch.zeros(n) for l in self.gates}
        self._handles: list[RemovableHandle] = [
            gate.register_forward_hook(self._hook(l)) for l, gate in self.gates.items()
        ]

    def _hook(self, layer: int):
        def count(module, args, output) -> None:
            _, idx = output
            self.counts[layer] += torch.bincount(idx.flatten(), minlength=len(self.counts[layer]))

        return count

    @torch.no_grad()
    def update(self) -> float:
        """Apply one bias step from the counts since the last call; returns max load / mean load."""
        worst = 1.0
        for l, gate in self.gates.items():
            counts = self.counts[l]
            if counts.sum() == 0:
                continue
            mean = counts.mean()
            gate.bias.add_(self.rate * torch.sign(mean - counts))
            worst = max(worst, float(counts.max() / mean))
            counts.zero_()
        return worst

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
