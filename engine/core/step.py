"""One engine step: what the scheduler hands a model runner, and what a runner must do.

Two runners implement ``ModelRunner``: ``ReferenceRunner`` (dense oracle over
real KV pages, reference_runner.py) and the production paged runner
(model_runner.py). The engine never looks inside either.

Contract of ``execute`` (docs/design/engine.md):

- ``PrefillChunk(seq, start, end, last)``: run the encoder path (layers below
  the CED boundary and the boundary layer's KV writes) over rows
  ``[start, end)`` of ``seq.token_ids`` under the sequence's admission plan
  (``stored_tokens``, ``encoder_start``, ``decoder_start``); write global KV of
  every complete compressed group starting at or after ``stored_tokens``. The
  first chunk of an admission starts at ``seq.encoder_start``. With
  ``last=True`` (``end == seq.prefill_end``) also run the decoder replay over
  rows ``[decoder_start, end)`` and return the logits of row ``end - 1``.
  A prefill-only sequence (``seq.prefill_only``) has ``decoder_start == end``:
  no decoder rows and no logits. Its last chunk may hold no rows at all (every
  page was already cached): then nothing runs.
- decode ``seq``: run row ``seq.num_tokens - 1`` (the token sampled last step)
  through every layer, write its KV, return its logits.
- verify ``seq`` (a decode with ``k = len(batch.drafts[seq.seq_id])`` drafts,
  already appended to ``seq.token_ids``): run rows ``[num_tokens - 1 - k,
  num_tokens)`` through every layer and return the logits of all of them,
  ``[k + 1, vocab]``. Rows the engine does not accept must leave no trace: when
  the sequence next runs, ``seq.num_computed`` says how many rows were kept, and
  the runner restores whatever state a dropped row overwrote (docs/design/engine.md,
  "How a verify step runs and rolls back").
- ``seq.block_table`` already covers every row the step writes. The runner
  does not move ``seq.num_computed``: the engine does, after ``execute``.
- Pages below ``stored_tokens`` and pages already committed are read only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.sequence import Sequence


@dataclass(slots=True)
class PrefillChunk:
    """Rows ``[start, end)`` of ``seq``'s current prefill; ``last`` yields logits."""

    seq: Sequence
    start: int
    end: int
    last: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class StepBatch:
    """One engine step: decode sequences first, then prefill chunks."""

    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    # seq_id -> the draft tokens a decode verifies this step (speculative decoding);
    # they are the last tokens of its ``token_ids`` until the engine accepts or drops them.
    drafts: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Rows charged to the step's token budget (encoder rows of chunks, one per
        decode, plus its drafts)."""
        drafted = sum(len(d) for d in self.drafts.values())
        return len(self.decodes) + drafted + sum(c.num_tokens for c in self.prefills)

    def num_drafts(self, seq: Sequence) -> int:
        """Draft rows ``seq`` verifies this step (0: a plain decode or a prefill)."""
        return len(self.drafts.get(seq.seq_id, ()))

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)

    def sampled(self) -> list[Sequence]:
        """Sequences that get a next token this step, in the order of ``execute``'s keys."""
        return self.decodes + [c.seq for c in self.prefills if c.last and not c.seq.prefill_only]

    def prefilled(self) -> list[Sequence]:
        """Prefill-only sequences whose last chunk runs this step (they get no token)."""
        return [c.seq for c in self.prefills if c.last and c.seq.prefill_only]


class ModelRunner(Protocol):
    def execute(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        """``seq_id -> next-token logits [vocab]`` (fp32) for every decode and last chunk;
        ``[k + 1, vocab]`` for a decode verifying ``k`` drafts."""
        ...

    def release(self, seq: Sequence) -> None:
        """Drop per-sequence runner state (SWA windows, compressor state); idempotent."""
        ...
