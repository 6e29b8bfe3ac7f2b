"""Where a decode step's time goes: ``torch.profiler`` over engine steps.

    .venv/bin/python bench/profile_step.py [--batch 1 8 32] [--steps 8] [--top 15]
    .venv/bin/python bench/profile_step.py --prefill 4096 [--top 15]

The tiny model (engine_bench's), one intra-op thread, the paged runner. For each
batch size: prefill ``batch`` requests of 48 tokens, then profile ``--steps``
decode steps and print, per step, the number of operator calls and the
operators with the most self CPU time (their share of the profiled time), and
the step's wall time. ``--prefill N``: instead, profile the whole prefill of one
N-token prompt (the engine's chunks, CED on: encoder rows for the prompt, the
decoder on the last window), totals for the prompt rather than per step. JSON in
``bench/results/profile_step.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.engine_bench import tiny_model  # noqa: E402
from engine.api.request import Request  # noqa: E402
from engine.api.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loader.builder import engine_for_model  # noqa: E402


def profile_decode(model, batch: int, steps: int, top: int) -> dict:
    engine = engine_for_model(EngineConfig(max_num_seqs=batch, kv_cache_bytes=256 << 20), model)
    gen = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            Request(f"r{i}", torch.randint(3, 120000, (48,), generator=gen).tolist(), params)
        )
    while engine.scheduler.waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # one warm decode step
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - t0) / steps
    return {"batch": batch, **_ranked(prof, steps, top, wall)}


def profile_prefill(model, tokens: int, top: int) -> dict:
    """The prefill of one ``tokens``-token prompt, to its first output token."""
    engine = engine_for_model(EngineConfig(max_num_seqs=1, kv_cache_bytes=256 << 20), model)
    gen = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = torch.randint(3, 120000, (tokens,), generator=gen).tolist()
    engine.add_request(Request("p", prompt, params))
    steps = 0
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
    wall = time.perf_counter() - t0
    return {"prefill_tokens": tokens, "engine_steps": steps, **_ranked(prof, 1, top, wall)}


def _ranked(prof, steps: int, top: int, wall: float) -> dict:
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events)
    calls = sum(e.count for e in events)
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "step_ms": wall * 1e3,
        "op_calls_per_step": calls / steps,
        "top": [
            {
                "op": e.key,
                "calls_per_step": e.count / steps,
                "self_ms_per_step": e.self_cpu_time_total / steps / 1e3,
                "share": e.self_cpu_time_total / total_self,
            }
            for e in ranked
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "profile_step.json")
    ap.add_argument("--prefill", type=int, default=None, help="profile one N-token prefill")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = tiny_model()
    if args.prefill:
        r = profile_prefill(model, args.prefill, args.top)
        print(
            f"prefill of {args.prefill} tokens: {r['step_ms'] / 1e3:.2f} s (profiled) in "
            f"{r['engine_steps']} engine steps, {r['op_calls_per_step']:.0f} op calls"
        )
        _print_top(r)
        results: dict | list[dict] = r
    else:
        results = []
        for batch in args.batch:
            r = profile_decode(model, batch, args.steps, args.top)
            results.append(r)
            print(
                f"batch {batch}: {r['step_ms']:.1f} ms/step (profiled), "
                f"{r['op_calls_per_step']:.0f} op calls/step"
            )
            _print_top(r)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")


def _print_top(r: dict) -> None:
    for t in r["top"]:
        share, ms, n = t["share"], t["self_ms_per_step"], t["calls_per_step"]
        print(f"  {share:6.1%}  {ms:9.2f} ms  {n:7.0f} calls  {t['op']}")


if __name__ == "__main__":
    main()
