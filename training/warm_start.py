"""Grow a trained demo model onto an extended tokenizer (bpe_extend.py) without losing it.

Three parts of the model depend on the vocabulary:
- ``embed`` and ``head``: old rows are kept; a new token's row starts as the
  mean of the rows of the old ids its bytes split into (what the model saw
  for that text before), so it starts out meaning what its pieces meant.
- Engram: the hash multipliers derive from the number of compressed classes
  (engine/model/deepseek_v41/engram.py), which the new tokens grow, so every n-gram lands
  on a different table row. Each new row starts as the mean of the old rows
  that the n-grams of the training plays hashed to before (n-grams of old
  ids only, whose classes are unchanged); rows no such n-gram reaches keep
  their old values.
- Everything else is copied as it is.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer

from engine.model.base import CausalLM
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.engram import build_compressed_vocab, engram_hash_rows
from engine.model.deepseek_v41.model import DeepseekV41
from training.bpe import PAD_ID
from training.demo_config import demo_config


def decomposition(old: Tokenizer, new: Tokenizer, token_id: int) -> list[int]:
    """The old ids that new token ``token_id``'s bytes split into under the old merges alone."""
    return [t.id for t in old.model.tokenize(new.id_to_token(token_id))]


@torch.no_grad()
def grow_model(
    model: CausalLM,
    old: Tokenizer,
    new: Tokenizer,
    play_ids: list[torch.Tensor],
) -> tuple[ModelConfig, DeepseekV41]:
    """A model for ``new`` (``old`` plus appended ids) initialised from ``model``.

    ``play_ids``: token streams of the training text under ``old`` (their
    n-grams carry the Engram tables over to the new hash).
    """
    old_cfg = model.config
    old_size = old_cfg.vocab_size
    class_of, n_classes = build_compressed_vocab(new)
    old_class_of, _ = build_compressed_vocab(old)
    if not torch.equal(class_of[:old_size], old_class_of):
        raise ValueError("the new tokenizer renumbers old ids' Engram classes")
    vocab_size = new.get_vocab_size(with_added_tokens=True)
    config = demo_config(vocab_size, n_classes, PAD_ID)
    grown = DeepseekV41(config)
    # The vocabulary grows: a drafter's vocabulary-sized heads would no longer fit, and
    # a drafter is distilled from the text model anyway (training/dspark_distill.py).
    grown.drop_drafter()
    grown.set_compressed_vocab(class_of)
    state = {n: t for n, t in model.state_dict().items() if not n.startswith("mtp.")}
    target = grown.state_dict()
    for name in ("embed.weight", "head.weight"):
        rows = torch.empty_like(target[name])
        rows[:old_size] = state[name]
        for token_id in range(old_size, vocab_size):
            rows[token_id] = state[name][decomposition(old, new, token_id)].mean(dim=0)
        state[name] = rows
    for layer_id in old_cfg.engram_layer_ids:
        name = f"layers.{layer_id}.engram.embed.weight"
        state[name] = _rehash_table(state[name], old_cfg, config, layer_id, old_class_of, play_ids)
    grown.load_state_dict(state)
    return config, grown


def _rehash_table(
    table: torch.Tensor,
    old_cfg: ModelConfig,
    new_cfg: ModelConfig,
    layer_id: int,
    class_of: torch.Tensor,
    streams: list[torch.Tensor],
) -> torch.Tensor:
    """Each row under the new hash: the mean of the old rows its n-grams came from."""
    total = torch.zeros_like(table)
    hits = torch.zeros(table.shape[0], dtype=table.dtype)
    pad = class_of[old_cfg.engram_pad_token_id]
    history = old_cfg.engram_max_ngram_size - 1
    for ids in streams:
        classes = torch.cat([pad.repeat(history), class_of[ids]])
        before = engram_hash_rows(classes, old_cfg, layer_id).flatten()
        after = engram_hash_rows(classes, new_cfg, layer_id).flatten()
        total.index_add_(0, after, table[before])
        hits.index_add_(0, after, torch.ones_like(after, dtype=table.dtype))
    out = table.clone()
    seen = hits > 0
    out[seen] = total[seen] / hits[seen, None]
    return out
