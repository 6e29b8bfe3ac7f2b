"""The DSpark proposer: the release's drafter (``model.dspark``) behind the Proposer protocol.

Per sequence it keeps each stage's ring of context KV: the last
``sliding_window`` committed rows, projected from the target layers' block
inputs that the engine hands to ``propose`` (``hidden``). A round drafts the
block after the newest token (the anchor) and returns its first ``k`` greedy
tokens, cut where the confidence head says the rest are unlikely to be
accepted (``min_confidence``; None: never cut). A sequence whose first drafts
keep being rejected drafts less often (``RejectionBackoff``,
engine/spec_decode/backoff.py; ``backoff=False``: every step). Drafts are point
masses, so the engine's verification stays exact (engine/spec_decode/proposer.py).

State is dense per sequence (CPU); see docs/design/dspark.md for the GPU plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from engine.core.sequence import Sequence
from engine.model.deepseek_v41.dspark.drafter import DSparkDrafter
from engine.spec_decode.backoff import RejectionBackoff
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import Draft


class DraftingModel(Protocol):
    """What the proposer reads of a model: its drafter (``dspark``, looked up by name)
    and the target's embedding and head. A ``CausalLM`` in one process; under
    parallel serving the core's drafter host (dspark/host.py), without the target's layers."""

    embed: nn.Embedding
    head: nn.Linear


@dataclass(slots=True)
class ContextRing:
    """One sequence's context: ``positions`` [S] and per stage ``kv[layer]`` [S, head_dim],
    S <= the window, positions increasing."""

    positions: torch.Tensor
    kv: dict[int, torch.Tensor] = field(default_factory=dict)


class DSparkProposer:
    """``DSparkProposer(model, spec)``: refuses a model without a drafter, and a K above
    the block size (a round drafts ``dspark_block_size`` tokens)."""

    def __init__(
        self,
        model: DraftingModel,
        spec: SpeculativeConfig,
        min_confidence: float | None = None,
        backoff: bool = True,
    ) -> None:
        drafter = getattr(model, "dspark", None)
        if not isinstance(drafter, DSparkDrafter):
            raise ValueError(
                "speculative method 'dspark' needs a checkpoint with a DSpark drafter (mtp.*)"
            )
        if not 1 <= spec.num_speculative_tokens <= drafter.block_size:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{drafter.block_size} "
                f"(dspark_block_size) for method 'dspark', got {spec.num_speculative_tokens}"
            )
        self.model = model
        self.drafter = drafter
        self.spec = spec
        self.min_confidence = min_confidence
        self.backoff = RejectionBackoff() if backoff else None
        self.hidden_layers: tuple[int, ...] = drafter.target_layer_ids
        self._rings: dict[int, ContextRing] = {}

    @torch.no_grad()
    def observe(self, seq: Sequence, hidden: dict[int, torch.Tensor]) -> None:
        """Add the committed rows of ``hidden`` (ending at row ``num_tokens - 2``) to the rings."""
        rows = hidden[self.hidden_layers[0]].shape[0]
        if rows == 0:
            return
        end = seq.num_tokens - 1
        device = self.model.embed.weight.device
        positions = torch.arange(end - rows, end, device=device)
        features = {
            l: hidden[l].to(device=device, dtype=self.model.embed.weight.dtype)
            for l in self.hidden_layers
        }
        new = self.drafter.context_kv(self.drafter.context(features), positions)
        ring = self._rings.get(seq.seq_id)
        if ring is None:
            ring = ContextRing(positions[:0], {l: kv[:0] for l, kv in new.items()})
        # Rows at or past the first new position were rolled back or are replayed.
        keep = ring.positions < positions[0]
        window = self.drafter.window
        ring.positions = torch.cat([ring.positions[keep], positions])[-window:]
        for l, kv in new.items():
            ring.kv[l] = torch.cat([ring.kv[l][keep], kv])[-window:]
        self._rings[seq.seq_id] = ring

    def propose(
        self, seq: Sequence, k: int, hidden: dict[int, torch.Tensor] | None = None
    ) -> Draft:
        return self.propose_many([(seq, k, hidden)])[0]

    @torch.no_grad()
    def propose_many(
        self, asks: list[tuple[Sequence, int, dict[int, torch.Tensor] | None]]
    ) -> list[Draft]:
        """``propose`` for several sequences, their rounds as one drafter forward (the
        drafter's linears and experts then run once per step, not once per sequence)."""
        drafts = [Draft() for _ in asks]
        rounds: list[int] = []  # the asks that draft this step
        rings: list[dict[int, torch.Tensor]] = []
        for i, (seq, k, hidden) in enumerate(asks):
            if hidden is not None:
                self.observe(seq, hidden)
            ring = self._rings.get(seq.seq_id)
            if ring is None or min(k, self.drafter.block_size) < 1 or ring.positions.numel() == 0:
                continue  # no context yet (nothing the target ran for this sequence)
            if self.backoff is not None and not self.backoff.should_draft(seq):
                continue
            # Only rows before the anchor are context (a sequence cut back keeps the rest out).
            before = ring.positions < seq.num_tokens - 1
            rings.append({l: kv[before] for l, kv in ring.kv.items()})
            rounds.append(i)
        if not rounds:
            return drafts
        seqs = [asks[i][0] for i in rounds]
        out = self.drafter.draft_many(
            [s.token_ids[-1] for s in seqs],
            [s.num_tokens - 1 for s in seqs],
            rings,
            self.model.embed,
            self.model.head,
        )
        for i, draft in zip(rounds, out, strict=True):
            seq, k = asks[i][0], min(asks[i][1], self.drafter.block_size)
            tokens = draft.tokens[:k].tolist()
            if self.min_confidence is not None:
                low = (draft.confidence[:k] < self.min_confidence).nonzero()
                if low.numel():
                    tokens = tokens[: int(low[0])]
            if self.backoff is not None:
                self.backoff.drafted(seq, tokens)
            drafts[i] = Draft(tokens)
        return drafts

    def release(self, seq: Sequence) -> None:
        self._rings.pop(seq.seq_id, None)
        if self.backoff is not None:
            self.backoff.release(seq)
