"""Mixture of experts: sqrt-softplus router, clamped SwiGLU experts.

See docs/design/architecture.md §1.8.

Checkpoint names: ``ffn.gate.weight`` / ``ffn.gate.bias`` (the
e_score_correction_bias), ``ffn.experts.E.w{1,2,3}.weight`` (the routed
experts, stored stacked: engine/model/deepseek_v41/routed_experts.py),
``ffn.shared_experts.w{1,2,3}.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.routed_experts import RoutedExperts, clamped_swiglu
from engine.model.ep_dispatch import ep_moe
from engine.model.parallel import SINGLE, Parallel
from engine.model.precision import upcast

# Added to the sum of the selected scores before normalising (DeepSeek's value).
ROUTE_NORM_EPS = 1e-20


class Expert(nn.Module):
    """``w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))``.

    The gate is clamped from above only (its negative tail goes through silu
    untouched); the up projection on both sides. A ``limit <= 0`` disables both.
    """

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, inter_dim, bias=False)  # gate
        self.w2 = nn.Linear(inter_dim, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, inter_dim, bias=False)  # up
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Expert output for ``x [T, D]``; ``weights [T, 1]`` scales it before ``w2``.

        The activation runs in fp32 and is cast back to ``x``'s dtype for ``w2``.
        """
        h = clamped_swiglu(upcast(self.w1(x)), upcast(self.w3(x)), self.swiglu_limit)
        if weights is not None:
            h = upcast(weights) * h
        return self.w2(h.to(x.dtype))


class Gate(nn.Module):
    """noaux_tc router: the bias picks experts, the raw scores weight them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.topk = config.num_experts_per_tok
        self.routed_scaling_factor = config.routed_scaling_factor
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        # e_score_correction_bias; selection only, kept in fp32 like the checkpoint.
        self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))
        # The release's selection bias for image positions (its vision-language
        # routing): picks the experts of a row of an image span in place of ``bias``.
        self.bias_vl = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, image_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] fp32, idx [T, k])`` for ``x [T, D]``.

        ``image_rows [T]`` bool: rows of an image span, whose experts ``bias_vl``
        picks; their weights come from the unbiased scores like every row's.
        """
        scores = F.softplus(F.linear(upcast(x), upcast(self.weight))).sqrt()
        bias = upcast(self.bias)
        if image_rows is not None:  # branch-free: no host sync on whether any row is one
            bias = torch.where(image_rows[:, None], upcast(self.bias_vl), bias)
        idx = torch.topk(scores + bias, self.topk, dim=-1).indices
        weights = scores.gather(-1, idx)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + ROUTE_NORM_EPS)
        return weights * self.routed_scaling_factor, idx


class MoE(nn.Module):
    """``y = sum_k w_k E_{idx_k}(x) + Shared(x)``, accumulated in fp32.

    ``parallel``: this rank holds its EP share of the routed experts and its TP
    share of the shared expert's intermediate dim; the router is replicated
    (docs/design/parallelism.md).
    """

    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        dim, inter, limit = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.n_routed_experts = config.n_routed_experts
        self.parallel = parallel
        self.gate = Gate(config)
        first, stop = parallel.experts(config.n_routed_experts)
        self.experts = RoutedExperts(
            stop - first, dim, inter, limit, first=first, total=config.n_routed_experts
        )
        shared = parallel.tp_part(inter * config.n_shared_experts, "shared expert intermediate")
        # The released config clamps the shared expert too (docs/design/architecture.md §1.8).
        self.shared_experts = Expert(dim, shared, limit)

    def forward(self, x: torch.Tensor, image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, D] -> [T, D]`` in ``x``'s dtype; ``image_rows``: see ``Gate.forward``."""
        p = self.parallel
        weights, idx = self.gate(x, image_rows)
        if p.ep_dispatch:  # other EP ranks hold other rows: pairs go to their experts' ranks
            y = ep_moe(self.experts, p, x, weights, idx)
        else:
            y = self.experts(x, weights, idx)  # this rank's experts' share (all, without EP)
        shared = upcast(self.shared_experts(x), y)  # this rank's TP share
        if p.ep_size > 1 and not p.ep_dispatch and p.same_group:
            y = p.ep_all_reduce(y + shared)  # TP x EP on one group: one all-reduce for both
        else:
            if p.ep_size > 1 and not p.ep_dispatch:
                y = p.ep_all_reduce(y)
            y = y + p.tp_all_reduce(shared)
        return y.to(x.dtype)
