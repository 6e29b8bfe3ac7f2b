"""The drafter's last-stage heads: the low-rank Markov bias and the confidence head.

Checkpoint names (under ``mtp.<last>.``): ``markov_head.embed.weight`` [V, r]
(the previous token's r-dim code, bf16), ``markov_head.head.weight`` [V, r]
(its vocabulary bias, fp32) and ``confidence_head.proj.weight`` [1, D + r]
(fp32). Both heads compute in fp32: the argmax of ``base + bias`` picks the
next drafted token, which feeds the next slot's bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.precision import upcast


class MarkovHead(nn.Module):
    """``bias(prev) = head @ embed[prev]``: a rank-r transition bias over the vocabulary,
    the only link between the tokens of one drafted block."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False, dtype=torch.float32)

    def code(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[n] -> [n, r] fp32 (or float64 in a float64 model)."""
        return upcast(self.embed(token_ids), self.head.weight)

    def bias(self, code: torch.Tensor) -> torch.Tensor:
        """[n, r] -> [n, V] in the compute dtype."""
        return F.linear(upcast(code, self.head.weight), upcast(self.head.weight, code))


class ConfidenceHead(nn.Module):
    """``sigmoid(proj [h ; code])``: the drafter's estimate that a slot's token is accepted,
    from the slot's collapsed (pre-norm) hidden state and its predecessor's Markov code."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim + rank, 1, bias=False, dtype=torch.float32)

    def forward(self, hidden: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        x = torch.cat([upcast(hidden, code), upcast(code, hidden)], dim=-1)
        return torch.sigmoid(F.linear(x, upcast(self.proj.weight, x))).squeeze(-1)
