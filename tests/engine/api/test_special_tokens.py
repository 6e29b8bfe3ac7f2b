"""The one hold-back for partial tags, against a brute-force oracle: every prefix of every tag."""

from __future__ import annotations

import itertools
import random

import pytest

from engine.api import special_tokens as st
from engine.api.special_tokens import partial_tag_tail

# Every tag the parsers and the detokenizer hold back for, plus stop-string-like ones
# whose prefixes overlap (a tail can begin several tags at once).
TAGS = [
    st.THINK_START,
    st.THINK_END,
    st.CALLS_OPEN,
    st.CALLS_CLOSE,
    st.INVOKE_OPEN,
    st.INVOKE_CLOSE,
    st.PARAM_OPEN,
    st.PARAM_CLOSE,
    "ab",
    "aab",
    "x",
]


def oracle(text: str, tags: list[str]) -> int:
    """The longest tail of ``text`` in the set of all proper prefixes of all tags."""
    prefixes = {t[:n] for t in tags for n in range(1, len(t))}
    return max((n for n in range(1, len(text) + 1) if text[-n:] in prefixes), default=0)


def test_every_prefix_of_every_tag_is_held_whole() -> None:
    for tag in TAGS:
        for n in range(1, len(tag)):
            assert partial_tag_tail("answer: " + tag[:n], TAGS) == oracle(
                "answer: " + tag[:n], TAGS
            )
            assert partial_tag_tail("answer: " + tag[:n], [tag]) == n


def test_a_whole_tag_is_not_held_back() -> None:
    # A complete tag is the caller's to find; only an unfinished one is held.
    assert partial_tag_tail("x" + st.THINK_END, [st.THINK_END]) == 0
    assert partial_tag_tail("x", ["x"]) == 0


@pytest.mark.parametrize("seed", range(4))
def test_random_texts_match_the_oracle(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = [*sorted(set("".join(TAGS))), "q", " "]
    for _ in range(3000):
        tags = rng.sample(TAGS, rng.randint(1, len(TAGS)))
        # Texts that end in pieces of tags, so long overlapping tails are common.
        pieces = [rng.choice(TAGS)[: rng.randint(0, 12)] for _ in range(rng.randint(0, 3))]
        noise = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
        text = noise + "".join(pieces)
        assert partial_tag_tail(text, tags) == oracle(text, tags), (text, tags)


def test_short_texts_exhaustively() -> None:
    tags = ["ab", "aab", "ba"]
    for length in range(6):
        for chars in itertools.product("abc", repeat=length):
            text = "".join(chars)
            assert partial_tag_tail(text, tags) == oracle(text, tags), text


def test_no_tags_hold_nothing() -> None:
    assert partial_tag_tail("anything", []) == 0
    assert partial_tag_tail("", TAGS) == 0
