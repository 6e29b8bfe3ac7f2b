"""``NgramProposer``: prompt lookup's choice of n-gram and occurrence, and its token mirror.

Oracles: drafts computed by hand, and a brute-force scan written out plainly
(every n from the largest, every start position from the left).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.core.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer, continuation_start


def proposer(min_n: int = 1, max_n: int = 3, **kw) -> NgramProposer:
    spec = SpeculativeConfig(
        "ngram", num_speculative_tokens=4, prompt_lookup_min=min_n, prompt_lookup_max=max_n
    )
    return NgramProposer(spec, **kw)


def seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), num_prompt_tokens=len(tokens))


def draft(tokens: list[int], k: int = 4, **kw) -> list[int]:
    return proposer(**kw).propose(seq(tokens), k).token_ids


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest tail n-gram with an earlier occurrence (ending before the last token),
    its leftmost occurrence, the k tokens after it."""
    size = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= size:
            continue
        tail = tokens[size - n :]
        for start in range(size - n):  # occurrence tokens[start : start + n], ends <= size - 1
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize(
    ("tokens", "min_n", "max_n", "k", "expected"),
    [
        # Tail [2, 3] (the 3-gram [4, 2, 3] never occurred) follows 1: three tokens remain.
        ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),
        # The 2-gram [1, 2] beats the more frequent 1-gram [2]: what followed 1 2 is drafted.
        ([7, 1, 2, 9, 5, 2, 8, 1, 2], 1, 3, 3, [9, 5, 2]),
        # Two occurrences of [4, 5]: the leftmost one (followed by 6) is taken.
        ([4, 5, 6, 4, 5, 7, 4, 5], 1, 2, 2, [6, 4]),
        # k caps the draft.
        ([4, 5, 6, 4, 5, 7, 4, 5], 1, 2, 1, [6]),
        # Nothing seen before: no draft.
        ([1, 2, 3], 1, 3, 4, []),
        # Only a 1-gram repeats: refused below min_n, drafted at min_n = 1.
        ([1, 2, 3, 1], 2, 3, 2, []),
        ([1, 2, 3, 1], 1, 3, 2, [2, 3]),
        # Overlap with the tail: [5, 5] occurs at 1..2, one token follows it.
        ([9, 5, 5, 5], 1, 2, 3, [5]),
        # [5, 5, 5] at 0..2 (max_n 3) leaves two tokens.
        ([5, 5, 5, 5, 5], 1, 3, 4, [5, 5]),
        # A single token has nothing before it.
        ([5], 1, 3, 4, []),
    ],
)
def test_hand_computed_drafts(
    tokens: list[int], min_n: int, max_n: int, k: int, expected: list[int]
) -> None:
    assert draft(tokens, k, min_n=min_n, max_n=max_n) == expected
    assert brute_force(tokens, min_n, max_n, k) == expected  # the oracle agrees by hand too


def test_latest_occurrence_takes_the_most_recent_match() -> None:
    assert draft([4, 5, 6, 4, 5, 7, 4, 5], 2, max_n=2, occurrence="latest") == [7, 4]
    # Longest n still wins over recency: [1, 2] (2-gram) not the later [2].
    assert draft([7, 1, 2, 9, 5, 2, 8, 1, 2], 3, occurrence="latest") == [9, 5, 2]


def test_random_sequences_match_the_brute_force_scan() -> None:
    rng = random.Random(11)
    for _ in range(600):
        vocab = rng.randint(1, 5)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        got = draft(tokens, k, min_n=min_n, max_n=max_n)
        assert got == brute_force(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_continuation_start_on_a_long_sequence() -> None:
    # 64K random tokens from a large vocabulary, one block copied: the tail (the
    # copy's first 3 tokens) is found where the block came from.
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 129_280, size=65_536, dtype=np.int32)
    tokens[-3:] = tokens[1000:1003]
    assert continuation_start(tokens, 1, 3) == 1003


class CountingList(list):
    """A token list that counts the elements read through slices (what a mirror converts)."""

    sliced = 0

    def __getitem__(self, i):  # type: ignore[override]
        out = super().__getitem__(i)
        if isinstance(i, slice):
            CountingList.sliced += len(out)
        return out


def test_the_mirror_converts_only_new_tokens_and_follows_the_sequence() -> None:
    p = proposer(max_n=2)
    s = seq([])
    s.token_ids = CountingList([3, 1, 4, 1, 5, 9, 2, 6] * 500)
    p.propose(s, 4)
    assert CountingList.sliced == 4000
    for t in (3, 1, 4):
        s.token_ids.append(t)
        CountingList.sliced = 0
        got = p.propose(s, 4).token_ids
        assert CountingList.sliced == 1  # one new token converted, not 4001
        assert got == brute_force(list(s.token_ids), 1, 2, 4)
    assert got == [1, 5, 9, 2]  # tail [3, 1, 4]: max_n 2 matches [1, 4] at its first place


def test_release_forgets_and_a_replaced_token_list_is_mirrored_afresh() -> None:
    p = proposer()
    a, b = seq([1, 2, 1], seq_id=1), seq([8, 9, 8], seq_id=2)
    assert p.propose(a, 2).token_ids == [2, 1]
    assert p.propose(b, 2).token_ids == [9, 8]  # separate mirrors per sequence
    p.release(a)
    p.release(a)  # idempotent
    assert set(p._mirrors) == {2}
    b.token_ids = [6, 7, 6]  # not a continuation of what was mirrored
    assert p.propose(b, 2).token_ids == [7, 6]
    assert p.hidden_layers == ()
    assert p.propose(b, 0).token_ids == []
