"""``flashserve make-tiny``: write the seeded random tiny checkpoint with its tokenizer."""

from __future__ import annotations

import argparse

NAME = "make-tiny"
HELP = "write a random ModelConfig.tiny() checkpoint (official layout) and tokenizer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    parser.add_argument(
        "--shard-bytes", type=int, default=None, help="split weights into shards of about this size"
    )


def run(args: argparse.Namespace) -> int:
    from engine.loader.checkpoint_writer import make_tiny

    print(make_tiny(args.out, args.seed, shard_bytes=args.shard_bytes))
    return 0
