"""Decode step cost of one or more git revisions, side by side in one run.

    .venv/bin/python bench/decode_bench.py --revs BASE HEAD WORKTREE [--repeats 3]

For each revision (a commit, or ``WORKTREE`` for the files as they are), a
fresh interpreter on that revision's code (``git archive`` into a temporary
directory) measures, with one intra-op thread and the tiny model:

- at batch 1, 8 and 32 (requests of 48 prompt tokens, all decoding): the median
  decode step (``LLMEngine.step``, unprofiled) and the operator calls per step
  (``torch.profiler``, counted over 2 further steps);
- the median decode step at 1K and 32K tokens of context (``engine_bench``'s P3
  setup: one sequence, synthetic FP4 global KV) and their ratio (goal <= 1.3).

Each step is timed twice: process CPU time (``*_cpu_ms``: with one intra-op
thread, the work itself, robust on a shared machine) and wall time
(``*_wall_ms``: also the waits for the shared cores).

Revisions alternate within each repeat (A, B, A, B, ...) so the machine's drift
hits them alike; the table shows the median over repeats. JSON in
``bench/results/decode_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKTREE = "WORKTREE"


# ---------------------------------------------------------------- worker (one revision)
def _decode_batch(model, batch: int, steps: int) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine.api.request import Request
    from engine.api.sampling_params import SamplingParams
    from engine.config import EngineConfig
    from engine.loader.builder import engine_for_model

    engine = engine_for_model(EngineConfig(max_num_seqs=batch, kv_cache_bytes=256 << 20), model)
    gen = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, 120000, (48,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", prompt, params))
    while engine.scheduler.waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # warm
    wall, cpu = _timed(engine.step, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            engine.step()
    calls = sum(e.count for e in prof.key_averages()) / 2
    return {"cpu_ms": cpu, "wall_ms": wall, "op_calls": calls}


def _timed(fn, n: int) -> tuple[float, float]:
    """Median wall and process-CPU milliseconds of ``n`` calls. With one intra-op thread
    the CPU time is the work itself; the wall time also holds waits for the shared cores."""
    wall, cpu = [], []
    for _ in range(n):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def _context_step(model, context: int, steps: int) -> tuple[float, float]:
    """engine_bench's P3 decode step (one sequence, ``context`` tokens of synthetic FP4
    global KV), timed as wall and CPU time."""
    import torch

    from bench.engine_bench import _manager, _sequence
    from engine.core.step import StepBatch
    from engine.runner.model_runner import PagedModelRunner
    from kernels.kv_cache_ops import store_kv_entries

    config = model.config
    kv, pool = _manager(config, context + steps + 1)
    runner = PagedModelRunner(model, pool, max_num_seqs=1)
    tokens = torch.randint(3, 120000, (context,), generator=torch.Generator().manual_seed(2))
    seq = _sequence(kv, config, tokens.tolist(), config.sliding_window, ced=True)
    table = torch.tensor(seq.block_table)
    gen = torch.Generator().manual_seed(3)
    for layer in config.kv_source_layer_ids:
        pages = pool.source(layer)
        n = context // config.compress_ratios[layer]
        for e0 in range(0, n, 4096):
            entries = torch.arange(e0, min(e0 + 4096, n))
            store_kv_entries(
                pages.main_data,
                pages.main_scales,
                pages.index_data,
                pages.index_scales,
                table[entries // pages.entries_per_page],
                entries % pages.entries_per_page,
                torch.randn(entries.numel(), config.head_dim, generator=gen),
                torch.randn(entries.numel(), config.index_head_dim, generator=gen),
            )

    def step() -> None:
        seq.token_ids.append(5 + len(seq.token_ids) % 100)
        seq.block_table = kv.allocate(0, seq.num_tokens)
        runner.execute(StepBatch(decodes=[seq]))

    step()  # warm
    return _timed(step, steps)


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    from bench.engine_bench import tiny_model

    model = tiny_model()
    out: dict[str, float] = {}
    for b in args.batch:
        r = _decode_batch(model, b, args.steps)
        out[f"b{b}_op_calls"] = r["op_calls"]
        out[f"b{b}_cpu_ms"] = r["cpu_ms"]
        out[f"b{b}_wall_ms"] = r["wall_ms"]
    for ctx in args.context:
        wall, cpu = _context_step(model, ctx, args.context_steps)
        out[f"ctx{ctx}_cpu_ms"], out[f"ctx{ctx}_wall_ms"] = cpu, wall
    if len(args.context) == 2:
        short, long = sorted(args.context)
        out["ctx_ratio_cpu"] = out[f"ctx{long}_cpu_ms"] / out[f"ctx{short}_cpu_ms"]
        out["ctx_ratio_wall"] = out[f"ctx{long}_wall_ms"] / out[f"ctx{short}_wall_ms"]
    print(json.dumps(out))


# ---------------------------------------------------------------- driver
def _tree(rev: str, into: Path) -> Path:
    if rev == WORKTREE:
        return REPO
    data = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True
    ).stdout
    dest = into / rev.replace("/", "_")
    dest.mkdir()
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def _run_worker(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    cmd = [
        sys.executable,
        str(tree / "bench" / "decode_bench.py"),
        "--worker",
        "--steps",
        str(args.steps),
        "--context-steps",
        str(args.context_steps),
        "--batch",
        *map(str, args.batch),
        "--context",
        *map(str, args.context),
    ]
    # Revisions older than this script run this file's worker on their own code.
    if not (tree / "bench" / "decode_bench.py").exists():
        cmd[1] = str(Path(__file__).resolve())
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"worker failed in {tree}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", nargs="+", default=[WORKTREE])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, nargs="*", default=[1024, 32768])
    ap.add_argument("--steps", type=int, default=8, help="timed decode steps per batch size")
    ap.add_argument("--context-steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "decode_bench.json")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    runs: dict[str, list[dict[str, float]]] = {r: [] for r in args.revs}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {r: _tree(r, Path(tmp)) for r in args.revs}
        for i in range(args.repeats):
            for rev in args.revs:
                runs[rev].append(_run_worker(trees[rev], args))
                print(f"repeat {i + 1}/{args.repeats} {rev}: done", file=sys.stderr, flush=True)
    medians = {r: {k: statistics.median(x[k] for x in v) for k in v[0]} for r, v in runs.items()}
    width = max(12, *(len(r) for r in args.revs))
    print(f"{'metric':<22}" + "".join(f"{r:>{width + 2}}" for r in args.revs))
    for key in medians[args.revs[0]]:
        row = "".join(f"{medians[r].get(key, float('nan')):>{width + 2}.3f}" for r in args.revs)
        print(f"{key:<22}{row}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "date": datetime.now(UTC).isoformat(timespec="minutes"),
                "machine": f"{platform.machine()}, 1 torch thread, CPU",
                "revs": args.revs,
                "medians": medians,
                "runs": runs,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
