"""Speculative decoding in the step loop: which decodes get drafts, how many, and the
acceptance counters (docs/design/engine.md, "How a verify step runs and rolls back").

After the scheduler picks a step's rows, each decode may carry up to K drafts
from the proposer: K is ``num_speculative_tokens``, capped by the room the
sequence has left (``max_tokens``, the context, the step's row budget, pages
the pool can give without preempting anyone). With more running and waiting
sequences than ``max_batch_size`` nobody drafts: a full batch is bound by bytes, where a draft
costs more than it saves. The drafts are appended to the sequence's tokens for
the runner to read; the engine takes them off again before it samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.step import ModelRunner, StepBatch
from engine.model.deepseek_v41.config import ModelConfig
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from engine.core.llm_engine import EngineCounters


# A runner's layer inputs of its last step: seq_id -> layer -> (first position, rows).
Hidden = dict[int, dict[int, tuple[int, torch.Tensor]]]


def make_speculator(
    spec: SpeculativeConfig | None,
    proposer: Proposer | None,
    runner: ModelRunner,
    scheduler: Scheduler,
    model_config: ModelConfig,
    max_model_len: int,
    counters: EngineCounters,
) -> Speculator | None:
    """The engine's speculator for ``spec`` (None: speculation off), or why it cannot run."""
    if spec is None:
        return None
    if proposer is None:
        raise ValueError("speculative_config is set but no proposer was built for it")
    if spec.num_speculative_tokens >= model_config.sliding_window:
        # A verify chunk's rows each need a ring slot of their own (verify_undo.py).
        raise ValueError(
            f"num_speculative_tokens must be below the sliding window "
            f"({model_config.sliding_window})"
        )
    take_hidden: Callable[[], Hidden] | None = None
    if proposer.hidden_layers:
        capture = getattr(runner, "capture_hidden", None)
        take_hidden = getattr(runner, "take_hidden", None)
        if capture is None or take_hidden is None:
            raise ValueError(
                f"the {spec.method} proposer reads the model's hidden states, which only "
                "the paged runner gives"
            )
        capture(tuple(proposer.hidden_layers))
    counters.spec_accepted_per_pos = [0] * spec.num_speculative_tokens
    return Speculator(
        spec, proposer, scheduler, max_model_len, counters, take_hidden, model_config.sliding_window
    )


class Speculator:
    """Drafts for a step's decodes, and what became of them."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        proposer: Proposer,
        scheduler: Scheduler,
        max_model_len: int,
        counters: EngineCounters,
        take_hidden: Callable[[], Hidden] | None = None,
        max_hidden_rows: int = 128,
    ) -> None:
        self.spec = spec
        self.proposer = proposer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.counters = counters
        # seq_id -> the layer inputs the proposer reads, of the committed rows since its
        # last proposal; the newest ``max_hidden_rows`` only (a long pause would
        # otherwise hoard them; a proposer already gets only a window after a prefill).
        self.hidden: dict[int, dict[int, torch.Tensor]] = {}
        self.take_hidden = take_hidden
        self.max_hidden_rows = max_hidden_rows

    def paused(self) -> bool:
        """A full batch decodes plainly. Waiting sequences count too: while a burst of
        requests is still being admitted, the few already decoding would otherwise
        draft beside the others' prefill chunks, in the steps a full batch runs."""
        cap = self.spec.max_batch_size
        load = len(self.scheduler.running) + len(self.scheduler.waiting)
        return cap is not None and load > cap

    def draft(self, batch: StepBatch, max_tokens_of: Callable[[Sequence], int]) -> None:
        """Propose for each decode of ``batch``; append the drafts to its tokens and
        record them in ``batch.drafts``. A proposer with ``propose_many`` (DSpark) is
        asked once for every decode with room, before the step's row budget is shared
        out: its drafts are prefixes of one greedy block, so a draft cut to the budget
        afterwards is the draft a smaller ask would have given."""
        if self.paused():
            return
        budget = self.scheduler.config.max_num_batched_tokens - batch.num_tokens
        kv = self.scheduler.kv
        # Committing k + 1 tokens must stay within max_tokens and the context.
        rooms = [
            (
                seq,
                min(
                    self.spec.num_speculative_tokens,
                    max_tokens_of(seq) - seq.num_output_tokens - 1,
                    self.max_model_len - seq.num_tokens - 1,
                ),
            )
            for seq in batch.decodes
        ]
        many = getattr(self.proposer, "propose_many", None)
        proposed: dict[int, list[int]] = {}
        if many is not None:
            asks = [(seq, room, self._take_hidden(seq)) for seq, room in rooms if room > 0]
            for (seq, _, _), d in zip(asks, many(asks), strict=True):
                proposed[seq.seq_id] = d.token_ids
        for seq, room in rooms:
            room = min(room, budget)
            if room <= 0:
                continue
            if many is not None:
                tokens = proposed[seq.seq_id][:room]
            else:
                tokens = self.proposer.propose(seq, room, self._take_hidden(seq)).token_ids[:room]
            if not tokens:
                continue
            # Pages for the drafts' rows, if the pool has them free: a draft never preempts.
            n = seq.num_tokens + len(tokens)
            if not kv.can_allocate(seq.seq_id, n):
                continue
            seq.block_table = kv.allocate(seq.seq_id, n)
            seq.token_ids.extend(tokens)
            batch.drafts[seq.seq_id] = list(tokens)
            budget -= len(tokens)

    def _take_hidden(self, seq: Sequence) -> dict[int, torch.Tensor] | None:
        return self.hidden.pop(seq.seq_id, None) if self.proposer.hidden_layers else None

    def keep_hidden(self, batch: StepBatch) -> None:
        """Keep, for the proposer's next call, the layer inputs of the rows ``batch``
        committed (positions below ``num_computed``), after what the sequence's
        earlier steps left since its last proposal."""
        if self.take_hidden is None:
            return
        captured = self.take_hidden()
        for seq in batch.decodes + [c.seq for c in batch.prefills]:
            layers = captured.get(seq.seq_id)
            if not layers or seq.is_finished:
                continue
            kept = self.hidden.setdefault(seq.seq_id, {})
            for layer, (first, rows) in layers.items():
                rows = rows[: max(0, seq.num_computed - first)]
                rows = torch.cat([kept[layer], rows]) if layer in kept else rows
                kept[layer] = rows[-self.max_hidden_rows :]

    def release(self, seq: Sequence) -> None:
        self.hidden.pop(seq.seq_id, None)
        self.proposer.release(seq)

    def count(self, drafted: int, accepted: int) -> None:
        """One verified draft of ``drafted`` tokens whose first ``accepted`` were taken."""
        c = self.counters
        c.spec_drafts += 1
        c.spec_draft_tokens += drafted
        c.spec_accepted_tokens += accepted
        if len(c.spec_accepted_per_pos) < drafted:
            c.spec_accepted_per_pos.extend([0] * (drafted - len(c.spec_accepted_per_pos)))
        for j in range(accepted):
            c.spec_accepted_per_pos[j] += 1
