"""A small byte-level BPE tokenizer for the demo, with the DeepSeek chat tokens.

Byte-level like DeepSeek's own (xgrammar reads the vocabulary as bytes, the
detokenizer decodes any id), trained with the ``tokenizers`` library. The
special tokens take the first ids in ``SPECIAL_TOKENS`` order, so BOS 0, EOS 1
and pad 2 match the real tokenizer; their strings are the ones the server's
chat encoding writes (server/chat/chat_encoding.py, server/chat/tool_calls.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SYSTEM = "<｜System｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
FIM_HOLE = "<｜fim▁hole｜>"
FIM_BEGIN = "<｜fim▁begin｜>"
FIM_END = "<｜fim▁end｜>"

# (token, special): as in DeepSeek's tokenizer, only BOS, EOS and pad are
# "special" (skipped when decoding with skip_special_tokens); the chat markers
# are added tokens that decode to their text.
SPECIAL_TOKENS: tuple[tuple[str, bool], ...] = (
    (BOS, True),
    (EOS, True),
    (PAD, True),
    (USER, False),
    (ASSISTANT, False),
    (SYSTEM, False),
    (THINK_START, False),
    (THINK_END, False),
    (DSML, False),
    (FIM_HOLE, False),
    (FIM_BEGIN, False),
    (FIM_END, False),
)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` ids (special tokens included)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer = _with_special_flags(tokenizer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise ValueError(f"BPE training stopped at {size} ids, wanted {vocab_size}")
    for token_id, (token, _) in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, token
    return tokenizer


def _with_special_flags(tokenizer: Tokenizer) -> Tokenizer:
    """The trainer marks every token it is given as special; restore DeepSeek's flags."""
    data = json.loads(tokenizer.to_str())
    flags = dict(SPECIAL_TOKENS)
    for entry in data["added_tokens"]:
        entry["special"] = flags[entry["content"]]
    return Tokenizer.from_str(json.dumps(data))


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path, max_length: int) -> None:
    """``tokenizer.json`` and a ``tokenizer_config.json`` like DeepSeek's (no auto BOS)."""
    tokenizer.save(str(out_dir / "tokenizer.json"))

    def added(content: str) -> dict[str, object]:
        return {"__type": "AddedToken", "content": content, "lstrip": False,
                "normalized": False, "rstrip": False, "single_word": False}  # fmt: skip

    config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": added(BOS),
        "eos_token": added(EOS),
        "pad_token": added(PAD),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
