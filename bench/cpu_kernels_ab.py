"""Decode step with and without the C loops (``kernels.cpu_native``), side by side.

One process, one intra-op thread, the tiny model; every measured step toggles
``FLASHSERVE_CPU_KERNELS`` (1, 0, 1, 0, ...) on the same engine, so both modes
see the same sequences and the same machine drift. Reports the median process
CPU time per step of each mode and operator calls per step (``torch.profiler``),
at batch 1 / 8 / 32 (48-token prompts, all decoding) and at 1K / 32K context
(``decode_bench``'s synthetic-KV single sequence; the two contexts' steps interleave
too, so their ratio is side by side), plus the engine overhead share
at the largest batch (step time outside the runner's forward, engine counters).

    python bench/cpu_kernels_ab.py --steps 10 --json bench/results/cpu_kernels_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.profiler import ProfilerActivity, profile

from kernels.cpu_native import ENV_VAR

MODES = ("1", "0")


def _ab(step: Callable[[], None], steps: int) -> dict[str, dict[str, float]]:
    return _ab_many({"": step}, steps)[""]


def _ab_many(
    steps_of: dict[str, Callable[[], None]], steps: int
) -> dict[str, dict[str, dict[str, float]]]:
    """Round robin over (setup, mode): every setup's steps in both modes interleave, so
    drift hits all of them alike (ratios between setups are side by side too)."""
    cpu = {(name, m): [] for name in steps_of for m in MODES}
    for step in steps_of.values():  # warm both paths
        for m in MODES:
            os.environ[ENV_VAR] = m
            step()
    for _ in range(steps):
        for name, step in steps_of.items():
            for m in MODES:
                os.environ[ENV_VAR] = m
                c0 = time.process_time()
                step()
                cpu[name, m].append(time.process_time() - c0)
    out: dict[str, dict[str, dict[str, float]]] = {name: {} for name in steps_of}
    for name, step in steps_of.items():
        for m in MODES:
            os.environ[ENV_VAR] = m
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            calls = sum(e.count for e in prof.key_averages())
            out[name][m] = {"cpu_ms": statistics.median(cpu[name, m]) * 1e3, "op_calls": calls}
    os.environ[ENV_VAR] = "1"
    return out


def _batch(model, batch: int, steps: int) -> tuple[dict, float]:
    from engine.api.request import Request
    from engine.api.sampling_params import SamplingParams
    from engine.config import EngineConfig
    from engine.loader.builder import engine_for_model

    engine = engine_for_model(EngineConfig(max_num_seqs=batch, kv_cache_bytes=256 << 20), model)
    gen = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps + 16, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, 120000, (48,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", prompt, params))
    while engine.scheduler.waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    c = engine.counters
    step0, exec0 = c.step_seconds, c.execute_seconds
    res = _ab(engine.step, steps)
    overhead = 1.0 - (c.execute_seconds - exec0) / (c.step_seconds - step0)
    return res, overhead


def _context(model, context: int, steps: int) -> Callable[[], None]:
    from bench.engine_bench import synthetic_context
    from engine.core.step import StepBatch

    kv, runner, seq = synthetic_context(model, context, 2 * steps + 8)

    def step() -> None:
        seq.token_ids.append(5 + len(seq.token_ids) % 100)
        seq.block_table = kv.allocate(0, seq.num_tokens)
        runner.execute(StepBatch(decodes=[seq]))

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="*", default=[1024, 32768])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per mode")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    from bench.engine_bench import tiny_model

    model = tiny_model()
    out: dict[str, object] = {}
    print(f"{'':14s} {'C loops: CPU ms':>16s} {'eager: CPU ms':>14s} {'ratio':>6s}   op calls")
    for b in args.batch:
        res, overhead = _batch(model, b, args.steps)
        out[f"batch{b}"] = {**res, "overhead_share": overhead}
        on, off = res["1"], res["0"]
        print(
            f"batch {b:<8d} {on['cpu_ms']:16.1f} {off['cpu_ms']:14.1f} "
            f"{on['cpu_ms'] / off['cpu_ms']:6.3f}   {on['op_calls']} vs {off['op_calls']}"
            f"   (engine overhead {overhead:.1%})"
        )
    # Each context's sequence grows by one token per step; size the pools for all of them.
    ctx_steps = {f"ctx{c}": _context(model, c, 2 * args.steps + 4) for c in args.context}
    for name, res in _ab_many(ctx_steps, args.steps).items():
        out[name] = res
        on, off = res["1"], res["0"]
        print(
            f"context {name[3:]:<6s} {on['cpu_ms']:16.1f} {off['cpu_ms']:14.1f} "
            f"{on['cpu_ms'] / off['cpu_ms']:6.3f}   {on['op_calls']} vs {off['op_calls']}"
        )
    if len(args.context) == 2:
        short, long = sorted(args.context)
        for m, name in (("1", "C loops"), ("0", "eager")):
            r = out[f"ctx{long}"][m]["cpu_ms"] / out[f"ctx{short}"][m]["cpu_ms"]
            out[f"ctx_ratio_{m}"] = r
            print(f"{long} / {short} context step, {name}: {r:.3f} (goal <= 1.3)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
