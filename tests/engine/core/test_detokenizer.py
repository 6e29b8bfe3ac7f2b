"""Incremental detokenization with the real DeepSeek V4 tokenizer.

Oracles: ``tokenizer.decode`` of all ids, ``tokenizers``' own ``DecodeStream``,
and the first occurrence of the stop string in the fully decoded text.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from engine.api.sampling_params import SamplingParams
from engine.core.detokenizer import IncrementalDetokenizer, check_stop_token
from engine.loader.tokenizer import load_tokenizer, packaged_tokenizer_path

EOS = 1
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "Party 🎉🎉 time 😀 with family 👩‍👩‍👧 and flags 🇫🇷🇯🇵.",
    "def f(x):\n    return x ** 2  # naïve café\n",
    "Mixed: 数学 e^{iπ}+1=0 ✓ — done…",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def _prompt(tok: Tokenizer) -> list[int]:
    return [0, *_ids(tok, "User: say something.\nAssistant:")]


def _run(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], int | None, str | None]:
    """Streamed pieces, the index of the token that stopped (if any), and its reason."""
    pieces: list[str] = []
    for i, token in enumerate(ids):
        delta = detok.push(token)
        pieces.append(delta.text)
        if delta.stopped:
            return pieces, i, delta.stop_reason
    pieces.append(detok.flush())
    return pieces, None, None


# -------------------------------------------------------------- tokenizer


def test_load_tokenizer_from_file_directory_or_package(tmp_path) -> None:
    packaged = load_tokenizer()
    assert packaged.get_vocab_size() == 129280
    assert packaged.id_to_token(EOS) == "<｜end▁of▁sentence｜>"
    (tmp_path / "tokenizer.json").write_text(packaged_tokenizer_path().read_text("utf-8"), "utf-8")
    for path in (tmp_path, tmp_path / "tokenizer.json", str(tmp_path)):
        assert load_tokenizer(path).encode("héllo 世界").ids == packaged.encode("héllo 世界").ids
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "missing")


# -------------------------------------------------------------- streaming


@pytest.mark.parametrize("text", TEXTS)
def test_stream_concatenation_equals_decode(tok: Tokenizer, text: str) -> None:
    ids = [*_ids(tok, text), EOS]
    pieces, stopped_at, _ = _run(IncrementalDetokenizer(tok, _prompt(tok)), ids)
    assert stopped_at is None
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_multibyte_characters_are_never_split(tok: Tokenizer) -> None:
    text = "🎉😀👩‍👩‍👧 你好"
    ids = _ids(tok, text)
    assert any(tok.decode([i]) == "\ufffd" for i in ids), "no byte-split token: test is moot"
    pieces, _, _ = _run(IncrementalDetokenizer(tok, []), ids)
    assert "".join(pieces) == text
    assert "" in pieces  # some tokens had to wait for the rest of their character
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_pieces_match_tokenizers_decode_stream(tok: Tokenizer, skip: bool) -> None:
    ids = [0, *_ids(tok, TEXTS[2] + " <think>x</think> " + TEXTS[1]), EOS]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    stream = DecodeStream(skip_special_tokens=skip)
    for token in ids:
        assert detok.push(token).text == (stream.step(tok, token) or "")
    assert detok.flush() == ""
    assert detok.text == tok.decode(ids, skip_special_tokens=skip)


def test_flush_returns_an_unfinished_character(tok: Tokenizer) -> None:
    ids = _ids(tok, "ok 🎉")
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.push(t).text for t in ids[:cut])
    assert streamed + detok.flush() == tok.decode(ids[:cut])


# ----------------------------------------------------------- stop strings


def _spanned_tokens(tok: Tokenizer, ids: list[int], text: str, stop: str) -> int:
    """How many tokens the first occurrence of ``stop`` touches."""
    start = text.index(stop)
    touched = 0
    for n in range(1, len(ids) + 1):
        before, upto = len(tok.decode(ids[: n - 1])), len(tok.decode(ids[:n]))
        touched += upto > start and before < start + len(stop)
    return touched


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(tok: Tokenizer, include: bool) -> None:
    text = TEXTS[0]
    ids = _ids(tok, text)
    stop = "k brown f"  # ends of " quick" / " brown" / " fox"
    assert _spanned_tokens(tok, ids, text, stop) == 3
    detok = IncrementalDetokenizer(
        tok, _prompt(tok), stop=[stop], include_stop_str_in_output=include
    )
    pieces, stopped_at, reason = _run(detok, ids)
    expected = "The quick brown f" if include else "The quic"
    assert "".join(pieces) == detok.text == expected
    assert reason == stop
    assert stopped_at == 3  # " fox" completes it
    # "k", then "k brown", were held back: they could begin the stop string.
    assert pieces == ["The", " quic", "", "k brown f" if include else ""]
    assert detok.finished and detok.flush() == ""


def test_stop_string_inside_one_token(tok: Tokenizer) -> None:
    ids = _ids(tok, "say hello world")
    assert "ell" in tok.decode([ids[1]])  # " hello" is one token
    for include, expected in [(False, "say h"), (True, "say hell")]:
        detok = IncrementalDetokenizer(tok, [], stop=["ell"], include_stop_str_in_output=include)
        pieces, stopped_at, reason = _run(detok, ids)
        assert ("".join(pieces), stopped_at, reason) == (expected, 1, "ell")


def test_multibyte_stop_string(tok: Tokenizer) -> None:
    text = "Party 🎉🎉 time"
    ids = _ids(tok, text)
    pieces, stopped_at, reason = _run(IncrementalDetokenizer(tok, [], stop=["🎉 t"]), ids)
    assert "".join(pieces) == "Party 🎉"
    assert reason == "🎉 t" and stopped_at is not None


def test_earliest_stop_wins_then_the_shorter(tok: Tokenizer) -> None:
    ids = _ids(tok, TEXTS[0])
    detok = IncrementalDetokenizer(tok, [], stop=["lazy", "over", "jumps over"])
    pieces, _, reason = _run(detok, ids)
    assert ("".join(pieces), reason) == ("The quick brown fox ", "jumps over")
    detok = IncrementalDetokenizer(
        tok, [], stop=["fox jumps", "fox"], include_stop_str_in_output=True
    )
    pieces, _, reason = _run(detok, ids)
    assert ("".join(pieces), reason) == ("The quick brown fox", "fox")


def test_no_stop_flush_returns_held_back_text(tok: Tokenizer) -> None:
    ids = _ids(tok, "hello wor")
    detok = IncrementalDetokenizer(tok, [], stop=["world"])
    streamed = "".join(detok.push(t).text for t in ids)
    assert streamed == "hello "  # "wor" could start "world"
    assert detok.flush() == "wor"
    assert detok.text == "hello wor"


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    ids = _ids(tok, "one two one two")
    # The first "two" is token 2 (<= min_tokens): ignored; the second one stops.
    detok = IncrementalDetokenizer(tok, [], stop=[" two"], min_tokens=2)
    pieces, stopped_at, _ = _run(detok, ids)
    assert ("".join(pieces), stopped_at) == ("one two one", 3)


def test_random_stops_against_decoded_text(tok: Tokenizer) -> None:
    rng = random.Random(0)
    for case in range(60):
        text = rng.choice(TEXTS)
        ids = _ids(tok, text)
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randint(1, 6)]
        extra = rng.choice(["zzz", "\n\n\n", "dog."])
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(
            tok, _prompt(tok), stop=[extra, stop], include_stop_str_in_output=include
        )
        pieces, stopped_at, reason = _run(detok, ids)
        # Oracle: the first stop occurrence in the whole text (the shorter on a tie).
        found = sorted((text.find(s), len(s), s) for s in {stop, extra} if s in text)
        first, _, want = found[0]
        assert reason == want, case
        assert "".join(pieces) == text[: first + (len(want) if include else 0)], case
        # The token that completes it, counting a character only once it is whole.
        done = next(
            n
            for n in range(1, len(ids) + 1)
            if want in tok.decode(ids[:n]) and not tok.decode(ids[:n]).endswith("\ufffd")
        )
        assert stopped_at == done - 1, case


def test_check_stop_token() -> None:
    params = SamplingParams(stop_token_ids=[7])
    assert check_stop_token(EOS, params, EOS) == "stop"
    assert check_stop_token(7, params, EOS) == "stop"
    assert check_stop_token(8, params, EOS) is None
    assert check_stop_token(EOS, SamplingParams(ignore_eos=True), EOS) is None
    assert check_stop_token(EOS, SamplingParams(), None) is None
