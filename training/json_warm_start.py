"""Warm-start the demo model onto a tokenizer that is cheap on JSON and tool syntax.

    git archive c4bdbb8 models/demo | tar -x -C /tmp/base     # the 4,096-id demo, 8K context
    .venv/bin/python -m training.json_warm_start --base /tmp/base/models/demo --out /tmp/s1
    .venv/bin/python -m training.json_warm_start --resume /tmp/s1 --out models/demo \
        --mix 0.4,0.1 --lr 3e-4 --warmup 10 --served-ends --short-replies 0.5 --eos-weight 3 \
        --minutes 25                                           # the committed demo

(or ``flashserve train-demo --base-only --out /tmp/base`` to rebuild that base from
nothing; without ``--base-only`` it runs all three steps).
Reads the 4,096-id demo checkpoint, appends ``NEW_IDS`` BPE merges
learnt on tool-call conversations (bpe_extend.py; the old merges keep their
ranks, so play text tokenises almost as before), grows the model onto the new
ids (warm_start.py) and fine-tunes it on plays, chat and tool-call
conversations for a wall-clock budget (``TrainConfig.max_seconds``: the
cosine decay follows elapsed time, as the shared machine's speed is not known
in advance; ``--steps`` fixes a step count instead, for a reproducible run).
Writes the checkpoint plus ``training.json``: the held-out bits per byte of
the old model, of the grown one before fine-tuning and after, and
the loss log. One CPU thread; deterministic for a seed on a given machine.

``--resume DIR`` skips the growing and fine-tunes an already extended
checkpoint further (``--mix``, ``--lr``, ``--warmup`` choose the second
stage's recipe, ``--served-ends`` its sequence ends, ``--short-replies`` and
``--eos-weight`` how much of the loss falls on the end of a reply; data.py,
trainer.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.loader.checkpoint import load_checkpoint
from engine.loader.checkpoint_writer import save_checkpoint
from engine.loader.tokenizer import load_tokenizer
from engine.model.base import CausalLM
from engine.model.deepseek_v41.config import ModelConfig
from training.bits_per_byte import bits_per_byte, heldout_spans
from training.bpe import write_tokenizer
from training.bpe_extend import extend_tokenizer
from training.chat_data import speeches
from training.corpus import Corpus, load_corpus
from training.data import SequenceSampler, encode_play, heldout_windows
from training.demo_config import DEMO_VOCAB_SIZE
from training.tool_data import tool_conversation
from training.trainer import TrainConfig, TrainResult, train
from training.warm_start import grow_model

# Appended ids: 768 take the hand-written JSON sample past 2.8 characters a token
# (256: 2.64, 512: 2.75); the plays lose 0.6% of their tokens to them.
NEW_IDS = 768
TOOL_CONVERSATIONS = 1000  # ~2.2 MB of tool-call text to learn the merges on
MERGE_SEED = 1
BPB_SPANS, BPB_CHARS = 32, 1024
EVAL_WINDOWS = 16
# The second stage of the committed demo (docs/QUALITY.md): sequences shaped as served,
# short chat replies and EOS weighted 3x, so that a chat reply ends with EOS.
SHIPPED_STAGE_2 = [
    "--mix", "0.4,0.1", "--lr", "3e-4", "--warmup", "10",
    "--served-ends", "--short-replies", "0.5", "--eos-weight", "3",
]  # fmt: skip
FINETUNE = TrainConfig(
    micro_batches=2,
    seq_len=256,
    lr=6e-4,
    warmup_steps=20,
    chat_fraction=0.2,
    tool_fraction=0.3,
    eval_every=100,
)


def tool_texts(replies: list[str], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [tool_conversation(rng, replies).text for _ in range(count)]


def stage_config(args: argparse.Namespace) -> TrainConfig:
    cfg = replace(FINETUNE, steps=args.steps or 100_000)
    if args.steps is None:
        cfg.max_seconds = args.minutes * 60
    if args.mix is not None:
        chat, tool = (float(x) for x in args.mix.split(","))
        cfg.chat_fraction, cfg.tool_fraction = chat, tool
    if args.lr is not None:
        cfg.lr = args.lr
    if args.warmup is not None:
        cfg.warmup_steps = args.warmup
    if args.seed is not None:
        cfg.seed = args.seed
    cfg.eos_weight = args.eos_weight
    return cfg


def train_and_save(
    model: CausalLM,
    config: ModelConfig,
    tokenizer: Tokenizer,
    corpus: Corpus,
    cfg: TrainConfig,
    args: argparse.Namespace,
    spans: list[str],
) -> tuple[TrainResult, float]:
    """Fine-tune ``model`` on the stage's mix, write it with its tokenizer to ``args.out``
    and score the written checkpoint: (training result, held-out bits per byte)."""
    sampler = SequenceSampler(
        tokenizer,
        corpus.train,
        cfg.seq_len,
        cfg.chat_fraction,
        cfg.seed,
        cfg.tool_fraction,
        served_ends=args.served_ends,
        short_replies=args.short_replies,
    )
    heldout = heldout_windows(tokenizer, corpus.heldout, cfg.seq_len, EVAL_WINDOWS)
    result = train(model, sampler, heldout, cfg, lambda s: print(s, flush=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, config, out)
    write_tokenizer(tokenizer, out, config.max_position_embeddings)
    _, served = load_checkpoint(out, quantization="none")
    bpb = bits_per_byte(served, tokenizer, spans)
    print(f"fine-tuned checkpoint: {bpb:.4f} bits/byte", flush=True)
    return result, bpb


def write_record(out: Path, record: dict, started: float, result: TrainResult) -> float:
    """``out/training.json``: the stage's ``record``, its wall time, torch and the loss log.
    Returns the wall seconds."""
    seconds = round(time.monotonic() - started, 1)
    record |= {"wall_seconds": seconds, "torch": torch.__version__, **result.to_dict()}
    with open(out / "training.json", "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return seconds


def resume(args: argparse.Namespace, cfg: TrainConfig) -> int:
    """Fine-tune the extended checkpoint ``args.resume`` further (a second stage)."""
    torch.set_num_threads(1)
    started = time.monotonic()
    torch.manual_seed(cfg.seed)
    corpus = load_corpus(Path(args.cache_dir))
    tokenizer = load_tokenizer(args.resume)
    if tokenizer.get_vocab_size(with_added_tokens=True) == DEMO_VOCAB_SIZE:
        raise SystemExit("--resume must be an extended checkpoint (this one has the old ids)")
    config, model = load_checkpoint(args.resume, quantization="none")
    spans = heldout_spans("".join(p.text for p in corpus.heldout), BPB_SPANS, BPB_CHARS)
    result, bpb = train_and_save(model, config, tokenizer, corpus, cfg, args, spans)
    out = Path(args.out)
    first = json.loads((Path(args.resume) / "training.json").read_text(encoding="utf-8"))
    record = {
        "stage_1": {k: v for k, v in first.items() if k != "log"},
        "stage_1_log": first.get("log", []),
        "stage_2": {
            "resumed_from": "stage 1's checkpoint (json_warm_start without --resume)",
            "served_ends": args.served_ends,
            "short_replies": args.short_replies,
            "eos_weight": args.eos_weight,
            "heldout_bits_per_byte": round(bpb, 4),
        },
    }
    seconds = write_record(out, record, started, result)
    print(f"wrote {out} in {seconds:.0f} s", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="the 4,096-id demo checkpoint to grow (not with --resume)")
    parser.add_argument("--out", required=True, help="where the new checkpoint goes")
    parser.add_argument("--cache-dir", default=".cache/corpus")
    parser.add_argument("--minutes", type=float, default=40.0, help="fine-tuning budget")
    parser.add_argument("--steps", type=int, default=None, help="fixed steps (no timing)")
    parser.add_argument("--resume", default=None, help="an extended checkpoint to fine-tune on")
    parser.add_argument(
        "--mix", default=None, help="chat,tool fractions (the rest is play windows), e.g. 0.3,0.1"
    )
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps")
    parser.add_argument(
        "--served-ends",
        action="store_true",
        help="play windows begin with BOS, chat sequences end with a reply's EOS",
    )
    parser.add_argument(
        "--short-replies",
        type=float,
        default=0.0,
        help="chance that a chat reply keeps only its first one or two sentences",
    )
    parser.add_argument(
        "--eos-weight", type=float, default=1.0, help="loss weight of EOS targets (1: plain)"
    )
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    cfg = stage_config(args)
    if args.resume is not None:
        return resume(args, cfg)
    if args.base is None:
        parser.error("--base or --resume is required")
    torch.set_num_threads(1)
    started = time.monotonic()
    torch.manual_seed(cfg.seed)

    corpus = load_corpus(Path(args.cache_dir))
    old = load_tokenizer(args.base)
    if old.get_vocab_size(with_added_tokens=True) != DEMO_VOCAB_SIZE:
        parser.error(f"--base must be the {DEMO_VOCAB_SIZE}-id demo (this one is extended)")
    _, base = load_checkpoint(args.base, quantization="none")
    replies = [s for p in corpus.train for s in speeches(p.text)]
    new = extend_tokenizer(old, tool_texts(replies, TOOL_CONVERSATIONS, MERGE_SEED), NEW_IDS)
    heldout_text = "".join(p.text for p in corpus.heldout)
    spans = heldout_spans(heldout_text, BPB_SPANS, BPB_CHARS)
    play_ids = [encode_play(old, p) for p in corpus.train]
    config, model = grow_model(base, old, new, play_ids)
    grown = copy.deepcopy(model)  # scored after training, so training starts at once

    result, bpb_new = train_and_save(model, config, new, corpus, cfg, args, spans)
    out = Path(args.out)
    bpb_old = bits_per_byte(base, old, spans)
    print(f"base model: {bpb_old:.4f} bits/byte", flush=True)
    bpb_grown = bits_per_byte(grown, new, spans)
    print(f"grown, before fine-tuning: {bpb_grown:.4f} bits/byte", flush=True)
    record = {
        "warm_start": {
            "base": "models/demo (800 steps, training.json of that run in git history)",
            "new_ids": NEW_IDS,
            "merge_corpus": f"{TOOL_CONVERSATIONS} tool_data conversations, seed {MERGE_SEED}",
            "heldout_bits_per_byte": {
                "spans": f"{BPB_SPANS} x {BPB_CHARS} characters of the held-out plays",
                "old": round(bpb_old, 4),
                "grown_before_finetune": round(bpb_grown, 4),
                "finetuned": round(bpb_new, 4),
            },
        },
    }
    seconds = write_record(out, record, started, result)
    final = result.log[-1].heldout_loss  # the last step always evaluates
    assert final is not None
    print(f"wrote {out} in {seconds:.0f} s; heldout ppl {math.exp(final):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
