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

    @property
    def num_tokens(self) -> int:
        """Rows charged to the step's token budget (encoder rows of chunks, one per decode)."""
        return len(self.decodes) + sum(c.num_tokens for c in self.prefills)

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
        """``seq_id -> next-token logits [vocab]`` (fp32) for every decode and last chunk."""
        ...

    def release(self, seq: Sequence) -> None:
        """Drop per-sequence runner state (SWA windows, compressor state); idempotent."""
        ...
