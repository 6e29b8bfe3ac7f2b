"""Which parts of a decode step dispatch its tensor operations.

    .venv/bin/python bench/op_breakdown.py [--batch 1]

One decode step of the tiny model (requests of 48 prompt tokens) runs under a
``TorchDispatchMode`` that counts every dispatched ATen operation and charges it
to the innermost labelled function on the Python stack (SWA store, sparse
attention, MoE, the mHC functions, the indexer, ...); the rest is ``other``.
Dispatch-level counts are lower than ``torch.profiler``'s (which also counts
the operations nested inside composite ones), but they split the step by
source. One intra-op thread.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine.model.deepseek_v41.attention as attention
import engine.model.deepseek_v41.indexer as indexer
import engine.model.deepseek_v41.layer as layer
import engine.model.deepseek_v41.moe as moe
import engine.runner.paged_backend as paged

# (owner, attribute, label): each wrapped for the duration of one breakdown.
_SITES = [
    (paged.PagedKV, "store_swa", "SWA store (FP8 record round trip, ring writes)"),
    (paged.PagedKV, "attend", "sparse attention"),
    (paged.PagedKV, "index_scores", "indexer scores (Full layers)"),
    (paged.PagedKV, "index_scores_at", "indexer scores at candidates (Reindex)"),
    (paged.PagedKV, "compressor_groups", "compressor groups"),
    (paged.PagedKV, "store_global", "global KV store"),
    (attention.Attention, "project_q", "q projection + RoPE"),
    (attention.Attention, "project_kv", "kv projection + RoPE"),
    (attention.Attention, "project_out", "output projection"),
    (indexer.Indexer, "queries", "indexer queries (MXFP4 query)"),
    (layer, "hc_coefficients", "mHC coefficients"),
    (layer, "hc_collapse", "mHC collapse"),
    (layer, "hc_mix", "mHC mix"),
    (moe.MoE, "forward", "MoE"),
    (attention, "select_topk", "top-k and candidate masks"),
    (attention, "candidate_block_mask", "top-k and candidate masks"),
    (attention, "select_topk_among", "top-k and candidate masks"),
    (attention, "mask_columns", "top-k and candidate masks"),
]


class _Count(TorchDispatchMode):
    def __init__(self, stack: list[str], counts: collections.Counter) -> None:
        super().__init__()
        self.stack, self.counts = stack, counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.stack[-1] if self.stack else "other"] += 1
        return func(*args, **(kwargs or {}))


def breakdown(model, batch: int = 1) -> collections.Counter:
    """Dispatched operations of one decode step at ``batch``, by source."""
    from engine.api.request import Request
    from engine.api.sampling_params import SamplingParams
    from engine.config import EngineConfig
    from engine.loader.builder import engine_for_model

    engine = engine_for_model(EngineConfig(max_num_seqs=batch, kv_cache_bytes=256 << 20), model)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    gen = torch.Generator().manual_seed(4)
    for i in range(batch):
        prompt = torch.randint(3, 120000, (48,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", prompt, params))
    while engine.scheduler.waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # warm
    stack: list[str] = []
    counts: collections.Counter = collections.Counter()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in _SITES]
    try:
        for (owner, name, label), (_, _, fn) in zip(_SITES, saved, strict=True):
            setattr(owner, name, _labelled(fn, label, stack))
        with _Count(stack, counts):
            engine.step()
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return counts


def _labelled(fn, label: str, stack: list[str]):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        stack.append(label)
        try:
            return fn(*args, **kwargs)
        finally:
            stack.pop()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    from bench.engine_bench import tiny_model

    counts = breakdown(tiny_model(), args.batch)
    total = sum(counts.values())
    print(f"batch {args.batch}: {total} dispatched operations in one decode step")
    for label, n in counts.most_common():
        print(f"{n:7d} {n / total:6.1%}  {label}")


if __name__ == "__main__":
    main()
