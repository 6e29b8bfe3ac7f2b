"""The rejection backoff's schedule, against hand-counted rounds."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.spec_decode.backoff import MAX_PAUSE, RejectionBackoff


@dataclass
class _Seq:
    seq_id: int = 0
    token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _step(backoff: RejectionBackoff, seq: _Seq, draft: int, target: int) -> bool:
    """One decode step: ask, draft ``draft`` if allowed, the target commits ``target``."""
    allowed = backoff.should_draft(seq)  # type: ignore[arg-type]
    if allowed:
        backoff.drafted(seq, [draft, draft])  # type: ignore[arg-type]
    seq.token_ids.append(target)
    return allowed


def test_two_misses_pause_two_steps_then_each_miss_doubles_the_pause() -> None:
    backoff, seq = RejectionBackoff(), _Seq()
    pattern = [_step(backoff, seq, draft=7, target=9) for _ in range(40)]
    # Drafted: steps 0, 1 (two misses), skip 2; step 4 misses -> skip 4; step 9 -> skip 8;
    # step 18 -> skip 16; step 35 -> skip 32 (the cap).
    drafted_at = [i for i, allowed in enumerate(pattern) if allowed]
    assert drafted_at == [0, 1, 4, 9, 18, 35]
    assert MAX_PAUSE == 32


def test_a_taken_first_draft_ends_the_schedule() -> None:
    backoff, seq = RejectionBackoff(), _Seq()
    for _ in range(2):
        _step(backoff, seq, draft=7, target=9)  # two misses: a pause of 2 starts
    assert [_step(backoff, seq, 7, 9) for _ in range(2)] == [False, False]
    assert _step(backoff, seq, draft=5, target=5)  # drafted and taken
    # A single miss after a taken draft does not pause: it takes two again.
    assert [_step(backoff, seq, 7, 9) for _ in range(3)] == [True, True, False]


def test_sequences_are_apart_and_release_forgets() -> None:
    backoff, a, b = RejectionBackoff(), _Seq(0), _Seq(1)
    for _ in range(2):
        _step(backoff, a, 7, 9)
    assert not backoff.should_draft(a)  # type: ignore[arg-type]
    assert backoff.should_draft(b)  # type: ignore[arg-type]
    backoff.release(a)  # type: ignore[arg-type]
    assert backoff.should_draft(a)  # type: ignore[arg-type]
