"""Appended BPE merges: learnt as BPE would (by hand), old ids and ranks kept, so text
tokenises as before except where a new merge fires on what the old ones leave."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from training.bpe import train_bpe
from training.bpe_extend import base_tokenizer, extend_tokenizer, learn_merges, word_pieces

PLAY = [
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
] * 20
JSON_LINES = [
    '{"name": "get_weather", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}, "days": {"type": "integer"}}}}\n'
] * 40


@pytest.fixture(scope="module")
def tokenizers():
    old = train_bpe(PLAY, 320)
    return old, extend_tokenizer(old, JSON_LINES, 40)


def test_learn_merges_by_hand() -> None:
    words = Counter({("a", "b", "c"): 3, ("a", "b"): 2, ("x", "y"): 4})
    # (a, b) 5 times, then (x, y) 4, then (ab, c) 3; (q, r) never occurs.
    assert learn_merges(words, 3, {"a", "b", "c", "x", "y"}) == [
        ("a", "b"),
        ("x", "y"),
        ("ab", "c"),
    ]
    # A merge whose result is already a token adds no id, so one more merge is taken.
    assert learn_merges(words, 1, {"a", "b", "c", "x", "y", "ab"}) == [("a", "b"), ("x", "y")]
    # Pairs seen once are not merged (min_frequency 2).
    assert learn_merges(Counter({("p", "q"): 1}), 5, {"p", "q"}) == []


def test_word_pieces_keep_chat_markers_out() -> None:
    old = train_bpe(PLAY, 320)
    # `{"`, `a`, `":`, ` 1`, `}` (GPT-2's split; the plays merged none of these bytes);
    # one-piece words have no pair to count, the markers are not words.
    words = word_pieces(old, ['<｜User｜>{"a": 1}<｜Assistant｜>'])
    assert words == Counter({("{", '"'): 1, ('"', ":"): 1, ("Ġ", "1"): 1})


def test_old_ids_and_merges_are_kept_and_new_ids_follow(tokenizers) -> None:
    old, new = tokenizers
    old_model = json.loads(old.to_str())["model"]
    new_model = json.loads(new.to_str())["model"]
    assert new.get_vocab_size(with_added_tokens=True) == 360
    assert new_model["merges"][: len(old_model["merges"])] == old_model["merges"]
    assert {k: new_model["vocab"][k] for k in old_model["vocab"]} == old_model["vocab"]
    assert sorted(new_model["vocab"].values()) == list(range(360))


def test_old_text_keeps_its_tokens_and_json_gets_cheaper(tokenizers) -> None:
    old, new = tokenizers
    text = PLAY[0]
    assert new.encode(text).ids == old.encode(text).ids
    line = JSON_LINES[0]
    before, after = old.encode(line).ids, new.encode(line).ids
    assert len(after) < len(before) / 2, (len(before), len(after))
    assert new.decode(after) == line
    # Every new token is a run of whole old tokens: appended merges only join.
    old_cuts = set(_cuts(old, line))
    assert set(_cuts(new, line)) <= old_cuts


def test_too_few_pairs_raise(tokenizers) -> None:
    old, _ = tokenizers
    with pytest.raises(ValueError, match="new ids"):
        extend_tokenizer(old, ["ab"], 10)


def _cuts(tokenizer, text: str) -> list[int]:
    return [end for _, end in tokenizer.encode(text).offsets]


def test_the_demo_recipe_makes_the_json_sample_cheap() -> None:
    """training/json_warm_start.py's merges on the committed demo tokenizer: the JSON sample
    goes from 1.82 characters a token to 2.8 and round-trips; play lines keep their cuts.
    The recipe draws the replies from the plays (2.809, bench/tokenizer_cost.py); with
    these two fixed ones it measures 2.797, hence the bound."""
    from pathlib import Path

    from engine.loader.tokenizer import load_tokenizer
    from training.demo_config import DEMO_VOCAB_SIZE, demo_checkpoint_dir
    from training.json_warm_start import MERGE_SEED, NEW_IDS, TOOL_CONVERSATIONS, tool_texts

    shipped = load_tokenizer(demo_checkpoint_dir())
    # The committed demo is the extended model; its first ids are the base it grew from.
    old = base_tokenizer(shipped, DEMO_VOCAB_SIZE)
    assert old.get_vocab_size() == DEMO_VOCAB_SIZE
    replies = ["Now is the winter of our discontent.", "What's past is prologue."]
    new = extend_tokenizer(old, tool_texts(replies, TOOL_CONVERSATIONS, MERGE_SEED), NEW_IDS)
    sample = (Path(__file__).parents[2] / "bench" / "data" / "tool_json_sample.txt").read_text()
    ids = new.encode(sample).ids
    assert len(sample) / len(old.encode(sample).ids) < 1.9
    assert len(sample) / len(ids) >= 2.79
    assert new.decode(ids, skip_special_tokens=False) == sample
    assert len(sample) / len(shipped.encode(sample).ids) >= 2.8  # the served tokenizer
    verse = "Ham. To be, or not to be: that is the question:\nWhether 'tis nobler in the mind\n"
    assert set(_cuts(new, verse)) <= set(_cuts(old, verse))
