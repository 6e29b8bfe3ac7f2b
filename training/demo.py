"""Build the demo checkpoint end to end: corpus, tokenizer, config, training, checkpoint."""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.loader.checkpoint_writer import save_checkpoint
from engine.model.deepseek_v41.engram import build_compressed_vocab
from engine.model.deepseek_v41.model import DeepseekV41
from training.bpe import PAD_ID, train_bpe, write_tokenizer
from training.corpus import SDIST_NAME, load_corpus
from training.data import SequenceSampler, heldout_windows
from training.demo_config import DEMO_VOCAB_SIZE, demo_config
from training.trainer import TrainConfig, train

# Held-out windows scored during training (the full table is bench/quality.py's).
EVAL_WINDOWS = 16
TRAINING_FILE = "training.json"


def build_demo(
    out_dir: Path,
    cache_dir: Path,
    cfg: TrainConfig,
    *,
    vocab_size: int = DEMO_VOCAB_SIZE,
    say: Callable[[str], None] = print,
) -> Path:
    """Train the demo model and write it to ``out_dir`` (official layout plus tokenizer).

    Also writes ``training.json``: the settings, the loss log and the corpus
    checksum, so the run can be compared with a rerun.
    """
    started = time.monotonic()
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(cache_dir)
    say(f"corpus: {len(corpus.train)} training plays, held out {[p.name for p in corpus.heldout]}")
    tokenizer = train_bpe((p.text for p in corpus.train), vocab_size)
    _, n_classes = build_compressed_vocab(tokenizer)
    config = demo_config(vocab_size, n_classes, PAD_ID)
    model = DeepseekV41(config)
    # The text model trains and ships alone: a DSpark drafter is distilled from it
    # afterwards, target frozen (docs/design/dspark.md). Dropped before the seeded
    # init, which draws the drafter last anyway, so the text weights are the same.
    model.drop_drafter()
    model.init_weights(torch.Generator().manual_seed(cfg.seed))
    model.set_compressed_vocab(build_compressed_vocab(tokenizer)[0])
    params = sum(p.numel() for p in model.parameters())
    say(f"model: {params / 1e6:.1f} M parameters, {n_classes} Engram classes")

    sampler = SequenceSampler(
        tokenizer, corpus.train, cfg.seq_len, cfg.chat_fraction, cfg.seed, cfg.tool_fraction
    )
    heldout = heldout_windows(tokenizer, corpus.heldout, cfg.seq_len, EVAL_WINDOWS)
    result = train(model, sampler, heldout, cfg, say)

    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, config, out_dir)
    write_tokenizer(tokenizer, out_dir, config.max_position_embeddings)
    sdist = (cache_dir / SDIST_NAME).read_bytes()
    record = {
        "corpus": {
            "sdist": SDIST_NAME,
            "sha256": hashlib.sha256(sdist).hexdigest(),
            "train_plays": [p.name for p in corpus.train],
            "heldout_plays": [p.name for p in corpus.heldout],
        },
        "parameters": params,
        "wall_seconds": round(time.monotonic() - started, 1),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        **result.to_dict(),
    }
    with open(out_dir / TRAINING_FILE, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    say(f"wrote {out_dir} in {record['wall_seconds']:.0f} s")
    return out_dir
