"""How far a restore's logits are from a recompute's, row by row (docs/QUALITY.md, (c)).

bench/quality.py (c) compares restore and recompute by KL to the exact
forward; this looks at the two directly. For each held-out window a prompt of
``--prompt`` tokens is admitted twice, recomputed (CED prefill) and restored
(the first ``--stored`` tokens' global KV from an earlier exact forward, the
rest replayed), and the continuation rows are teacher-forced under each plan.
Printed: the largest absolute logit difference per window, and how many
windows have a row past ``--threshold``, with the weights dequantised
(``--quantization none``: fp32 rounding only) or as served (``auto``: FP8
linears that quantise their activations, where rounding can cross a step).

    .venv/bin/python bench/restore_drift.py                        # dequantised, ~10 min
    .venv/bin/python bench/restore_drift.py --quantization auto --windows 16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from engine.loader.checkpoint import load_checkpoint
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.reference import KVPrecision, ReplayPlan, forward
from training.corpus import load_corpus
from training.data import heldout_windows
from training.demo_config import demo_checkpoint_dir

EXACT = KVPrecision(global_kv="exact", swa="exact")


@torch.no_grad()
def max_drift(model: DeepseekV41, ids: torch.Tensor, prompt: int, stored: int) -> float:
    """The largest |restore - recompute| logit over the rows predicting the continuation."""
    config = model.config
    ratios = {l: config.compress_ratios[l] for l in config.kv_source_layer_ids}
    held = forward(model, ids, ReplayPlan.exact(config), None, EXACT).global_kv.prefix(
        stored, ratios
    )
    rows = []
    for H, kv in ((0, None), (stored, held)):
        plan = ReplayPlan.prefill(config, prompt, config.sliding_window, stored_tokens=H)
        logits = forward(model, ids, plan, kv, EXACT).logits
        rows.append(logits[prompt - 1 - plan.logits_start : len(ids) - 1 - plan.logits_start])
    return float((rows[0] - rows[1]).abs().max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(demo_checkpoint_dir()), help="checkpoint dir")
    parser.add_argument("--cache-dir", default=".cache/corpus", help="corpus sdist cache")
    parser.add_argument("--quantization", default="none", choices=["none", "auto"])
    parser.add_argument("--windows", type=int, default=128, help="held-out windows")
    parser.add_argument("--length", type=int, default=256, help="tokens per window")
    parser.add_argument("--prompt", type=int, default=192, help="prompt tokens")
    parser.add_argument("--stored", type=int, default=128, help="stored prefix tokens")
    parser.add_argument("--threshold", type=float, default=1e-4, help="a drift past rounding")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    _, model = load_checkpoint(args.model, quantization=args.quantization)
    model.eval()
    tokenizer = load_tokenizer(args.model)
    corpus = load_corpus(Path(args.cache_dir))
    windows = heldout_windows(tokenizer, corpus.heldout, args.length, args.windows)
    drifts = [max_drift(model, ids, args.prompt, args.stored) for ids in windows]
    print(f"largest drift per window: {' '.join(f'{d:.1e}' for d in drifts)}")
    over = sum(d > args.threshold for d in drifts)
    print(f"max {max(drifts):.2e}; {over} of {len(drifts)} windows past {args.threshold:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
