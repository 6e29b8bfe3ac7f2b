"""Growing a model onto appended ids: old rows kept, new embedding/head rows the mean of
their old pieces' rows (pieces found by the old tokenizer's own encode), Engram rows
carried to the new hash by a position-by-position loop."""

from __future__ import annotations

import pytest
import torch

from engine.model.deepseek_v41.engram import build_compressed_vocab, engram_hash_rows
from engine.model.deepseek_v41.model import DeepseekV41
from training.bpe import BOS_ID, PAD_ID, train_bpe
from training.bpe_extend import extend_tokenizer
from training.demo_config import demo_config
from training.warm_start import grow_model

PLAY = [
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
] * 20
JSON_LINES = ['{"name": "get_weather", "parameters": {"type": "object"}}\n'] * 40


@pytest.fixture(scope="module")
def grown():
    old = train_bpe(PLAY, 320)
    new = extend_tokenizer(old, JSON_LINES, 16)
    _, classes = build_compressed_vocab(old)
    model = DeepseekV41(demo_config(320, classes, PAD_ID))
    model.init_weights(torch.Generator().manual_seed(0))
    model.set_compressed_vocab(build_compressed_vocab(old)[0])
    stream = torch.tensor([BOS_ID, *old.encode(PLAY[0]).ids])
    config, bigger = grow_model(model, old, new, [stream])
    return old, new, model, config, bigger, stream


def test_config_grows_by_the_new_ids_and_classes(grown) -> None:
    _, new, model, config, bigger, _ = grown
    assert config.vocab_size == 336
    assert config.engram_compressed_vocab_size == build_compressed_vocab(new)[1]
    assert config.engram_compressed_vocab_size > model.config.engram_compressed_vocab_size
    assert torch.equal(bigger.engram_vocab_map[:320], model.engram_vocab_map)


def test_new_rows_are_the_mean_of_their_old_pieces(grown) -> None:
    old, new, model, _, bigger, _ = grown
    for name in ("embed.weight", "head.weight"):
        before, after = model.state_dict()[name], bigger.state_dict()[name]
        assert torch.equal(after[:320], before)
        for token_id in range(320, 336):
            pieces = old.encode(new.decode([token_id])).ids
            assert len(pieces) >= 2
            assert torch.allclose(after[token_id], before[pieces].mean(0)), (name, token_id)


def test_other_weights_are_copied(grown) -> None:
    _, _, model, _, bigger, _ = grown
    after = bigger.state_dict()
    for name, value in model.state_dict().items():
        if name in ("embed.weight", "head.weight") or name.endswith("engram.embed.weight"):
            continue
        if name.startswith("mtp."):  # a drafter does not grow with the vocabulary
            assert name not in after, name
            continue
        assert torch.equal(after[name], value), name


def test_engram_rows_follow_their_ngrams_to_the_new_hash(grown) -> None:
    _, _, model, config, bigger, stream = grown
    old_cfg = model.config
    class_of = model.engram_vocab_map
    history = old_cfg.engram_max_ngram_size - 1
    classes = torch.cat([class_of[PAD_ID].repeat(history), class_of[stream]])
    for layer in old_cfg.engram_layer_ids:
        name = f"layers.{layer}.engram.embed.weight"
        table, moved = model.state_dict()[name], bigger.state_dict()[name]
        sources: dict[int, list[int]] = {}
        for t in range(len(stream)):  # one position at a time: a second path
            window = classes[t : t + history + 1]
            rows_old = engram_hash_rows(window, old_cfg, layer)[0].tolist()
            rows_new = engram_hash_rows(window, config, layer)[0].tolist()
            for a, b in zip(rows_old, rows_new, strict=True):
                sources.setdefault(b, []).append(a)
        assert sources
        for row, olds in sources.items():
            assert torch.allclose(moved[row], table[olds].mean(0), atol=1e-6), (layer, row)
        untouched = [r for r in range(table.shape[0]) if r not in sources]
        assert torch.equal(moved[untouched], table[untouched])
