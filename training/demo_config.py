"""The demo model: ``ModelConfig.tiny()``'s topology sized for a 30-minute CPU training run.

Same layer roles as the tiny preset (8 layers: SWA-only 0-1, Full 2 (ratio 2,
Engram), Reuse 3, Full 4 (ratio 1, candidate source, CED boundary), Reuse 5,
Reindex 6, Reuse 7; Engram on 1 and 2), with the demo tokenizer's vocabulary,
4 attention heads (the dense reference's attention is most of a training step),
a 32-token sliding window and a top-32 indexer with 8 candidate blocks of 8, so
that 256-token sequences exercise top-k and candidate filtering.
"""

from __future__ import annotations

from pathlib import Path

from engine.model.deepseek_v41.config import ModelConfig, engram_table_primes

DEMO_NAME = "demo"
DEMO_VOCAB_SIZE = 4096
# Engram primes start above this (docs/design/architecture.md §1.9): ~4k rows per head and order.
DEMO_ENGRAM_VOCAB = 4000
# The engine's max_model_len: room for a coding agent's first request (its system prompt
# and tool schemas, up to ~30K demo tokens) plus the 32K output it asks for. Training saw
# 256 tokens; RoPE is relative, the SWA layers see 32 and the compressed layers' YaRN
# already spans 65,536 original positions, so positions past 256 are a question of quality,
# measured in docs/QUALITY.md (bits per byte at 8K to 64K, bench/context_ppl.py --paged).
DEMO_MAX_POSITIONS = 65536


def demo_config(vocab_size: int, compressed_vocab_size: int, pad_token_id: int) -> ModelConfig:
    """The demo's config for a tokenizer of ``vocab_size`` ids folding to that many classes."""
    tiny = ModelConfig.tiny()
    orders, layers = tiny.engram_orders, len(tiny.engram_layer_ids)
    primes = engram_table_primes(DEMO_ENGRAM_VOCAB, layers, orders, tiny.engram_n_heads)
    return tiny.replace(
        vocab_size=vocab_size,
        engram_compressed_vocab_size=compressed_vocab_size,
        engram_pad_token_id=pad_token_id,
        engram_vocab_size=DEMO_ENGRAM_VOCAB,
        engram_num_embeddings=[sum(p) for p in primes],
        # DSpark weights are not part of the text model; the id must still be a real token.
        dspark_noise_token_id=pad_token_id,
        # The drafter (``train-demo --stage dspark``) reads the last three layers' block
        # inputs, as the release reads its last three (training/dspark_stage.py).
        dspark_target_layer_ids=[5, 6, 7],
        num_attention_heads=4,
        sliding_window=32,
        index_topk=32,
        candidate_topk_blocks=8,
        max_position_embeddings=DEMO_MAX_POSITIONS,
    )


def demo_checkpoint_dir() -> Path:
    """``models/demo`` of the source tree: what ``--model demo`` serves."""
    return Path(__file__).resolve().parents[1] / "models" / DEMO_NAME
