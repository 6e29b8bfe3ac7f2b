"""The demo tokenizer: DeepSeek's special ids and flags, byte-level round trips, and a
tokenizer_config.json that the transformers tokenizer loader reads (a second consumer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.bpe import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    THINK_END,
    USER,
    train_bpe,
    write_tokenizer,
)

TEXT = [
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(TEXT, 320)


def test_special_tokens_take_the_first_ids(tokenizer) -> None:
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 320
    assert [tokenizer.token_to_id(t) for t, _ in SPECIAL_TOKENS] == list(range(12))
    assert (tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)) == (0, 1)
    assert tokenizer.token_to_id(PAD) == 2


def test_chat_markers_are_single_ids_and_survive_decoding(tokenizer) -> None:
    text = f"{BOS}{USER}Who's there?{ASSISTANT}{THINK_END}Nay, answer me.{DSML}{EOS}"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[:2] == [0, 3] and ids[-1] == 1
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # As in DeepSeek's tokenizer only BOS/EOS/pad are dropped when skipping specials.
    assert tokenizer.decode(ids) == f"{USER}Who's there?{ASSISTANT}{THINK_END}Nay, answer me.{DSML}"


def test_byte_level_round_trip_of_unseen_text(tokenizer) -> None:
    text = "Ωμέγα — naïve café 🎭\n\tend"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids) == text


def test_written_files_load_in_transformers(tmp_path: Path, tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    write_tokenizer(tokenizer, tmp_path, 1024)
    loaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 1, 2)
    assert loaded.model_max_length == 1024
    assert loaded("To be", add_special_tokens=True).input_ids[0] != 0  # no automatic BOS
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["add_bos_token"] is False
