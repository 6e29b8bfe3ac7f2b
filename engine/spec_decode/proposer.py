"""What a proposer is to the engine: per sequence, up to K draft tokens per step.

The engine verifies a sequence's draft as one chunk of ``K + 1`` rows through
every layer: the token sampled last and the K drafts. Row ``j``'s logits are
sampled as a plain decode step would sample them (history = committed tokens +
drafts ``0..j-1``) and drafts are accepted while the sample equals them; the
first mismatch (or the row after the last draft) gives the step's last token.

Drafts here are point masses (a proposer's greedy choice, or a lookup): for a
point-mass proposal, "sample the target's row and compare" is exactly
rejection sampling (accept ``d`` with probability ``p(d)``; on rejection the
sample is distributed as ``p`` without ``d``, renormalised, the residual), and
it draws one sample per committed token, so a seeded request gives the same
tokens with and without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.sequence import Sequence


@dataclass(slots=True)
class Draft:
    """Up to K proposed next tokens of one sequence (may be empty: nothing to propose)."""

    token_ids: list[int] = field(default_factory=list)


class Proposer(Protocol):
    """Drafts tokens for running sequences; owns whatever per-sequence state it keeps."""

    # Target layer ids whose attention inputs (``[rows, hc, hidden]``) the proposer
    # reads from the rows each step commits; () for a proposer that reads tokens only.
    hidden_layers: tuple[int, ...]

    def propose(
        self, seq: Sequence, k: int, hidden: dict[int, torch.Tensor] | None = None
    ) -> Draft:
        """At most ``k`` drafts following ``seq.token_ids``.

        ``hidden[layer]`` (None when ``hidden_layers`` is empty): that layer's input
        ``R [rows, hc, hidden]`` (the residual streams entering the block) at the
        last ``rows`` committed positions, ending at row ``seq.num_tokens - 2`` (the
        newest token has not run yet). Rows committed since the previous call that
        the layer ran: a verify step's accepted rows; after a prefill, the rows the
        decoder replay covered (CED: the last window), so fewer than were committed.
        """
        ...

    def release(self, seq: Sequence) -> None:
        """Forget ``seq`` (finished, aborted or preempted); idempotent."""
        ...

    # Optional: ``propose_many(asks: list[(seq, k, hidden)]) -> list[Draft]``, the
    # drafts of every decode of a step at once (engine/core/speculation.py asks it
    # once per step where a proposer has it; DSpark's runs one drafter forward).
