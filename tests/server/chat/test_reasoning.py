"""The </think> splitter: hand-written outputs, every split point, and the whole-text path."""

from __future__ import annotations

import random

import pytest
from chat_helpers import split_reasoning

from engine.loader.tokenizer import load_tokenizer
from server.chat.reasoning import ReasoningParser


def stream(pieces: list[str], *, starts_in_reasoning: bool = True) -> list[tuple[str, str]]:
    parser = ReasoningParser(in_reasoning=starts_in_reasoning)
    out = [parser.feed(p) for p in pieces]
    out.append(parser.finish())
    return out


def joined(deltas: list[tuple[str, str]]) -> tuple[str, str]:
    return "".join(r for r, _ in deltas), "".join(c for _, c in deltas)


def test_whole_text() -> None:
    text = "The user greets me.</think>Hello!"
    assert joined(stream([text])) == ("The user greets me.", "Hello!")
    assert joined(stream(["no end yet"])) == ("no end yet", "")
    off = stream(["Hi </think> x"], starts_in_reasoning=False)
    assert joined(off) == ("", "Hi </think> x")
    # Only the first </think> ends reasoning; a later one is answer text.
    assert joined(stream(["a</think>b</think>c"])) == ("a", "b</think>c")
    # The oracle of the split tests below agrees on these.
    assert split_reasoning("a</think>b</think>c") == ("a", "b</think>c")
    assert split_reasoning("no end yet") == ("no end yet", "")


def test_stream_with_tag_as_one_delta() -> None:
    deltas = stream(["Let me ", "think.", "</think>", "Answer", " here."])
    assert deltas == [
        ("Let me ", ""),
        ("think.", ""),
        ("", ""),
        ("", "Answer"),
        ("", " here."),
        ("", ""),
    ]


def test_partial_tag_is_held_back() -> None:
    parser = ReasoningParser()
    assert parser.feed("hmm </th") == ("hmm ", "")
    assert parser.feed("in") == ("", "")
    assert parser.feed("k>ok") == ("", "ok")
    # A false start is released as reasoning once it cannot be the tag.
    parser = ReasoningParser()
    assert parser.feed("a </t") == ("a ", "")
    assert parser.feed("able>") == ("</table>", "")
    assert parser.finish() == ("", "")


def test_held_tail_is_reasoning_at_the_end() -> None:
    parser = ReasoningParser()
    assert parser.feed("cut off </thi") == ("cut off ", "")
    assert parser.finish() == ("</thi", "")


def test_thinking_off_passes_everything_as_content() -> None:
    assert joined(stream(["a</think>", "b"], starts_in_reasoning=False)) == ("", "a</think>b")


@pytest.mark.parametrize("seed", range(5))
def test_any_split_matches_the_whole_text(seed: int) -> None:
    rng = random.Random(seed)
    text = (
        "I should add </th and </think > and <think>; done.</think>\n\nThe sum is 4. </think> again"
    )
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 25)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    deltas = stream(pieces)
    assert joined(deltas) == split_reasoning(text)
    # Equality also rules out a streamed partial tag: it would end the reasoning.
    assert all("</think>" not in r for r, _ in deltas)


def test_character_by_character() -> None:
    text = "abc</think>def"
    assert joined(stream(list(text))) == ("abc", "def")


def test_end_tag_survives_detokenization() -> None:
    # </think> is an added token that is not "special": decoding with
    # skip_special_tokens keeps it, so the text-level split sees it.
    tokenizer = load_tokenizer()
    ids = tokenizer.encode("why</think>because", add_special_tokens=False).ids
    assert 128822 in ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert split_reasoning(text) == ("why", "because")
