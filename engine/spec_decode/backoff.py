"""Draft less for a sequence whose drafts keep being rejected.

A DSpark round costs a drafter forward whether or not its drafts are taken, so
on text the drafter cannot guess (a JSON copy from far back in the prompt, say)
speculation is slower than plain decoding (docs/BENCHMARKS.md). Per sequence:
after ``MISSES_TO_PAUSE`` rounds in a row whose first draft was rejected, skip
drafting for ``pause`` steps (2 at first, doubling on each miss after a pause,
at most ``MAX_PAUSE``); a round whose first draft is taken ends the pause
schedule. Skipping changes no token: a step without drafts is a plain decode.

A round's outcome is read from the sequence itself at the next proposal: the
token committed at the first draft's position equals the draft or not (also
when the engine did not verify the draft, for want of pages: the committed
token is still what the target chose there).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.sequence import Sequence

MISSES_TO_PAUSE = 2
MAX_PAUSE = 32


@dataclass(slots=True)
class _State:
    position: int = -1  # where the last round's first draft stood (-1: none pending)
    first: int = -1  # that draft token
    misses: int = 0  # rounds in a row whose first draft was rejected
    pause: int = 0  # the current pause length (0: not pausing)
    skip: int = 0  # steps of the pause still to skip


class RejectionBackoff:
    """``should_draft(seq)`` before a round, ``drafted(seq, tokens)`` after it."""

    def __init__(self) -> None:
        self._states: dict[int, _State] = {}

    def should_draft(self, seq: Sequence) -> bool:
        state = self._states.setdefault(seq.seq_id, _State())
        self._read_outcome(seq, state)
        if state.skip > 0:
            state.skip -= 1
            return False
        return True

    def drafted(self, seq: Sequence, tokens: list[int]) -> None:
        state = self._states.setdefault(seq.seq_id, _State())
        if tokens:
            state.position, state.first = seq.num_tokens, tokens[0]

    def release(self, seq: Sequence) -> None:
        self._states.pop(seq.seq_id, None)

    def _read_outcome(self, seq: Sequence, state: _State) -> None:
        if state.position < 0 or seq.num_tokens <= state.position:
            return  # nothing pending, or not committed yet
        taken = seq.token_ids[state.position] == state.first
        state.position = -1
        if taken:
            state.misses = state.pause = 0
            return
        state.misses += 1
        # After a pause one more miss starts the next, longer one.
        if state.misses >= (1 if state.pause else MISSES_TO_PAUSE):
            state.pause = min(max(2, 2 * state.pause), MAX_PAUSE)
            state.skip = state.pause
            state.misses = 0
