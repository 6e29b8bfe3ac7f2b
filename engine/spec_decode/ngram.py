"""Prompt lookup (vLLM's ``ngram`` method): draft what followed the sequence's tail before.

A sequence that copies from its own context (an edited file, a JSON document
re-emitted with a few fields changed, a quoted passage) repeats n-grams it has
already seen. The proposer takes the last ``n`` tokens, ``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``, finds an earlier occurrence
of them in the sequence's own tokens (prompt and outputs), and drafts the (up
to ``k``) tokens that followed it. No model runs, so it reads no hidden states.

Which occurrence: the longest ``n`` that occurs, then, among its occurrences,
the earliest, as vLLM's proposer chooses (its KMP scan keeps the leftmost
match of the longest length). ``occurrence="latest"`` takes the most recent
one instead (the bench compares the two). An occurrence may overlap the tail
itself (``a a a``: the tail ``a a`` occurs one token earlier); it must end
before the sequence does, so at least one token follows it.

Cost: each sequence's tokens are mirrored into a growing ``int32`` array (only
the tokens committed since the previous call are converted), and a lookup is
one vectorised comparison over the array for the tail's last token followed by
``n - 1`` filters over the surviving candidates: tens of microseconds at 64K
tokens, not a Python scan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from engine.core.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import Draft

Occurrence = Literal["earliest", "latest"]


def continuation_start(
    tokens: np.ndarray, min_n: int, max_n: int, occurrence: Occurrence = "earliest"
) -> int | None:
    """Index of the token right after the chosen earlier occurrence of ``tokens``'s tail.

    The tail is ``tokens[L-n:]`` for the largest ``n`` in ``[min_n, max_n]`` that
    also occurs ending at some ``e <= L - 1`` (``tokens[e-n:e]``); the result is
    that ``e`` (earliest or latest among the occurrences). None: no ``n`` occurs.
    """
    size = len(tokens)
    if size < 2:
        return None
    # Ends e (exclusive) of the occurrences of the 1-token tail: tokens[e-1] == last, e < L.
    ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1]) + 1
    best = ends if min_n <= 1 and len(ends) else None
    for n in range(2, max_n + 1):
        # Extend each surviving occurrence one token to the left, if it still matches.
        ends = ends[ends >= n]
        if len(ends):
            ends = ends[tokens[ends - n] == tokens[size - n]]
        if not len(ends):
            break
        if n >= min_n:
            best = ends
    if best is None:
        return None
    return int(best[0] if occurrence == "earliest" else best[-1])


@dataclass(slots=True)
class _Mirror:
    """A sequence's tokens as a growing array (``ids[:length]``), appended to each call."""

    ids: np.ndarray
    length: int = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """``token_ids`` as an array view, converting only the tokens not mirrored yet."""
        new = len(token_ids)
        last = self.length - 1
        if new < self.length or (last >= 0 and token_ids[last] != self.ids[last]):
            # Not the list mirrored before (committed tokens only grow): start over.
            self.length = 0
        if new > len(self.ids):
            grown = np.empty(max(new, 2 * len(self.ids)), dtype=np.int32)
            grown[: self.length] = self.ids[: self.length]
            self.ids = grown
        if new > self.length:
            self.ids[self.length : new] = token_ids[self.length : new]
            self.length = new
        return self.ids[:new]


class NgramProposer:
    """Drafts up to ``k`` tokens per sequence by prompt lookup; keeps one token mirror per
    sequence, dropped in ``release``."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, spec: SpeculativeConfig, occurrence: Occurrence = "earliest") -> None:
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max
        self.occurrence: Occurrence = occurrence
        self._mirrors: dict[int, _Mirror] = {}

    def propose(
        self, seq: Sequence, k: int, hidden: dict[int, torch.Tensor] | None = None
    ) -> Draft:
        if k <= 0:
            return Draft()
        mirror = self._mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = self._mirrors[seq.seq_id] = _Mirror(np.empty(0, dtype=np.int32))
        tokens = mirror.sync(seq.token_ids)
        start = continuation_start(tokens, self.min_n, self.max_n, self.occurrence)
        if start is None:
            return Draft()
        return Draft(tokens[start : start + k].tolist())

    def release(self, seq: Sequence) -> None:
        self._mirrors.pop(seq.seq_id, None)
