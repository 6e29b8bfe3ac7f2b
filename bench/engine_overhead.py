"""Engine overhead at a batch of decode streams: the share of step time outside the forward.

    .venv/bin/python bench/engine_overhead.py [--batch 32] [--steps 12] [--repeats 2]

The tiny checkpoint (``make_tiny``) dequantised in fp32, one intra-op thread,
``batch`` greedy requests of 48 random tokens, all prefilled before measuring;
then ``steps`` decode steps. The share is ``1 - execute / step`` from the
engine's own counters (``EngineCounters``: the runner's forward vs the whole
``LLMEngine.step``: scheduling, sampling, appending, detokenising). Issue 17's
goal: <= 5 % at batch 32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoint import load_checkpoint
from engine.checkpoint_writer import make_tiny
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams


def overhead_share(model, batch: int, steps: int) -> float:
    engine = LLMEngine.build(EngineConfig(max_num_seqs=batch, kv_cache_bytes=256 << 20), model)
    gen = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, 120000, (48,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", prompt, params))
    while engine.scheduler.waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    c = engine.counters
    step0, exec0 = c.step_seconds, c.execute_seconds
    for _ in range(steps):
        engine.step()
    return 1.0 - (c.execute_seconds - exec0) / (c.step_seconds - step0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny(tmp, 0)
        _, model = load_checkpoint(tmp, quantization="none", dtype=torch.float32)
    shares = [overhead_share(model, args.batch, args.steps) for _ in range(args.repeats)]
    runs = " / ".join(f"{s:.1%}" for s in shares)
    print(f"batch {args.batch}: engine overhead {statistics.median(shares):.1%} ({runs})")


if __name__ == "__main__":
    main()
