"""Engine overhead at a batch of decode streams: the share of step time outside the forward.

    .venv/bin/python bench/engine_overhead.py [--batch 32] [--steps 12] [--repeats 2]

``engine_bench.decode_throughput`` on its tiny model (fp32, one intra-op
thread): ``batch`` greedy requests of 48 random tokens, all prefilled before
measuring, then ``steps`` tokens each. The share is ``1 - execute / step`` from
the engine's own counters (the runner's forward vs the whole ``LLMEngine.step``:
scheduling, sampling, appending, detokenising). The goal (docs/BENCHMARKS.md): <= 5 % at
batch 32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench import decode_throughput, tiny_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = tiny_model()
    shares = [
        decode_throughput(model, args.batch, args.steps)["overhead_share"]
        for _ in range(args.repeats)
    ]
    runs = " / ".join(f"{s:.1%}" for s in shares)
    print(f"batch {args.batch}: engine overhead {statistics.median(shares):.1%} ({runs})")


if __name__ == "__main__":
    main()
