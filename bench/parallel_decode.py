"""Decode throughput of parallel serving on CPU: 2 worker ranks vs one process, equal cores.

    PYTHONPATH=. python bench/parallel_decode.py [--streams 32] [--steps 20] [--threads 2]

One process runs with ``--threads`` intra-op threads; each topology's 2 ranks get
``--threads / 2`` each (equal total cores). The tiny checkpoint (written to a
temporary directory), float32, weights dequantised; ``--streams`` greedy
requests of 64 prompt tokens. After every stream is decoding, ``--steps``
decode-only steps are timed: decode tokens/s, ms per step, and for the ranks
the slowest rank's forward per step, the time inside torch.distributed
collectives (waiting for the slower rank included) and the rest of the step
(the step channel, serialisation, the core's scheduling and sampling).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.loader.builder import build_engine
from engine.loader.checkpoint_writer import make_tiny

TOPOLOGIES = {
    "1 process": {},
    "TP2": {"tensor_parallel_size": 2},
    "DP2 x EP2": {"data_parallel_size": 2, "enable_expert_parallel": True},
    "TP2 x EP2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}


def run(checkpoint: Path, name: str, args: argparse.Namespace) -> dict[str, float]:
    flags = TOPOLOGIES[name]
    ranks = 2 if flags else 1
    threads = max(1, args.threads // ranks)
    torch.set_num_threads(args.threads if not flags else 1)
    config = EngineConfig(
        quantization="none",
        max_num_seqs=args.streams,
        max_num_batched_tokens=4096,
        kv_cache_bytes=64 << 20,
        worker_threads=threads,
        **flags,
    )
    engine = build_engine(config, checkpoint)
    try:
        g = torch.Generator().manual_seed(0)
        for i in range(args.streams):
            ids = torch.randint(3, 129000, (64,), generator=g).tolist()
            params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
            engine.add_request(Request(f"s{i}", ids, params))
        while engine.counters.decode_rows == 0 or len(engine.scheduler.running) < args.streams:
            engine.step()
        for _ in range(2):  # warm
            engine.step()
        times = getattr(engine.runner, "times", None)
        if times is not None:
            times.reset()
        rows = engine.counters.decode_rows
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - t0
        tokens = engine.counters.decode_rows - rows
        out = {"tok_s": tokens / wall, "step_ms": wall / args.steps * 1e3}
        if times is not None:
            out["forward_ms"] = times.forward_max / times.steps * 1e3
            out["comm_ms"] = max(times.comm) / times.steps * 1e3
            out["channel_ms"] = out["step_ms"] - out["forward_ms"]
        return out
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=list(TOPOLOGIES))
    args = parser.parse_args()
    os.environ["FLASHSERVE_TIME_COLLECTIVES"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny(Path(tmp) / "tiny")
        print(f"{args.streams} streams, {args.steps} decode steps, {args.threads} cores in all")
        print("| topology | decode tok/s | ms/step | slowest forward | in collectives | rest |")
        print("|---|---|---|---|---|---|")
        for name in args.only:
            r = run(checkpoint, name, args)
            extra = "| - | - | -"
            if "forward_ms" in r:
                extra = f"| {r['forward_ms']:.1f} | {r['comm_ms']:.1f} | {r['channel_ms']:.1f}"
            print(f"| {name} | {r['tok_s']:.0f} | {r['step_ms']:.1f} {extra} |", flush=True)


if __name__ == "__main__":
    main()
