"""Token text and bytes for logprobs, against the tokenizer's own decoder and hand values."""

from __future__ import annotations

import math
import random

import pytest
from tokenizers import Tokenizer

from engine.api.request import TokenLogprob as EngineLogprob
from engine.loader.tokenizer import load_tokenizer
from server.openai.logprobs import (
    MIN_LOGPROB,
    TokenTexts,
    byte_level_alphabet,
    clamp_logprob,
    extend_completion_logprobs,
    extend_prompt_logprobs,
)
from server.openai.protocol import CompletionLogprobs


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def texts(tokenizer: Tokenizer) -> TokenTexts:
    return TokenTexts(tokenizer)


def test_byte_level_alphabet_hand_values() -> None:
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == 0x41 and alphabet["~"] == 0x7E and alphabet["¡"] == 0xA1
    assert alphabet["Ā"] == 0x00  # the first non-printable byte takes U+0100
    assert alphabet["Ġ"] == 0x20 and alphabet["Ċ"] == 0x0A and alphabet["ĉ"] == 0x09


@pytest.mark.parametrize(
    "text", ["Hello, world!", "héllo wörld", "日本語のテキスト 🙂👍🏽", "\t\n  x"]
)
def test_token_bytes_join_to_the_text(tokenizer: Tokenizer, texts: TokenTexts, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert b"".join(texts.get(i)[1] for i in ids) == text.encode()


def test_token_text_matches_the_decoder(tokenizer: Tokenizer, texts: TokenTexts) -> None:
    """Every whole-character token reads as the tokenizer decodes it alone."""
    added = set(tokenizer.get_added_tokens_decoder())
    ids = random.Random(0).sample(range(tokenizer.get_vocab_size()), 3000)
    checked = 0
    for i in ids:
        if i in added:
            continue
        text, raw = texts.get(i)
        try:
            expected = raw.decode("utf-8")
        except UnicodeDecodeError:
            assert "\ufffd" in text
            continue
        assert text == expected == tokenizer.decode([i])
        checked += 1
    assert checked > 2000


def test_added_tokens_are_their_own_text(tokenizer: Tokenizer, texts: TokenTexts) -> None:
    think_end = tokenizer.token_to_id("</think>")
    assert texts.get(think_end) == ("</think>", b"</think>")
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    assert texts.get(eos)[1] == "<｜end▁of▁sentence｜>".encode()


def test_clamp_logprob() -> None:
    assert clamp_logprob(-1.5) == -1.5
    assert clamp_logprob(-math.inf) == MIN_LOGPROB == -9999.0
    assert clamp_logprob(math.nan) == MIN_LOGPROB
    assert clamp_logprob(-1e6) == MIN_LOGPROB


def test_chat_entry(tokenizer: Tokenizer, texts: TokenTexts) -> None:
    hello, comma = (tokenizer.token_to_id(t) for t in ("Hello", ","))
    entry = texts.chat_entry(EngineLogprob(hello, -0.25, [(hello, -0.25), (comma, -math.inf)]))
    assert entry.model_dump() == {
        "token": "Hello",
        "logprob": -0.25,
        "bytes": list(b"Hello"),
        "top_logprobs": [
            {"token": "Hello", "logprob": -0.25, "bytes": list(b"Hello")},
            {"token": ",", "logprob": -9999.0, "bytes": [44]},
        ],
    }


def test_completion_logprobs_rows_and_offsets(tokenizer: Tokenizer, texts: TokenTexts) -> None:
    a, b = (tokenizer.encode(t, add_special_tokens=False).ids[0] for t in ("Hi", " there"))
    out = CompletionLogprobs()
    offset = extend_prompt_logprobs(out, texts, [a], 0)
    assert offset == 2
    offset = extend_completion_logprobs(
        out, texts, [EngineLogprob(b, -1.0, [(b, -1.0), (a, -2.0)])], offset
    )
    assert offset == 8
    assert out.tokens == ["Hi", " there"]
    assert out.token_logprobs == [None, -1.0]
    assert out.top_logprobs == [None, {" there": -1.0, "Hi": -2.0}]
    assert out.text_offset == [0, 2]
