"""Decode step time with packed FP8 linears vs weights dequantised at load.

    .venv/bin/python bench/packed_bench.py [--dtype bfloat16] [--batch 1 8] [--steps 24]

The tiny checkpoint (``make_tiny``, written to a temporary directory), loaded
twice: ``quantization="auto"`` (dense FP8 linears keep their E4M3 bytes; each
matmul quantises its activations per 32 and dequantises its weight a tile at a
time) and ``quantization="none"`` (every weight in ``--dtype``). One intra-op
thread, the paged runner; for each batch size both engines prefill the same
``batch`` prompts of 48 tokens, then decode steps alternate between the two
engines so drifts in machine load hit both. Prints the median step time of each,
their ratio (the goal: packed <= 1.5x on CPU), the same for the step's
CPU time (``time.thread_time``: the steadier figure on a shared host, where wall
time includes waiting for a core) and the bytes the dense FP8 linears hold; JSON
in ``bench/results/packed_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.api.request import Request  # noqa: E402
from engine.api.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.loader.builder import engine_for_model  # noqa: E402
from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.loader.checkpoint_writer import make_tiny  # noqa: E402
from engine.model.deepseek_v41.fp8_linear import packed_modules  # noqa: E402


def _engine(model, batch: int, steps: int) -> LLMEngine:
    engine = engine_for_model(EngineConfig(max_num_seqs=batch, kv_cache_bytes=256 << 20), model)
    gen = torch.Generator().manual_seed(4)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, 120000, (48,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", prompt, params))
    while engine.scheduler.waiting or any(
        s.num_output_tokens == 0 for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # one warm decode step
    return engine


def _step_s(engine: LLMEngine) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one engine step.

    The CPU time leaves out the time the thread waits for a core: on a shared host
    it is the steadier measure of the work (one intra-op thread, in this thread).
    """
    t0, c0 = time.perf_counter(), time.thread_time()
    engine.step()
    return time.perf_counter() - t0, time.thread_time() - c0


def dense_fp8_bytes(model) -> dict[str, int]:
    """Bytes of the dense FP8-block linears as this model holds them."""
    packed = packed_modules(model)
    return {"linears": len(packed), "bytes": sum(m.resident_bytes for m in packed.values())}


def run(dtype: str, batches: list[int], steps: int) -> dict:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "tiny", seed=0)
        models = {
            q: load_checkpoint(path, dtype=getattr(torch, dtype), quantization=q)[1].eval()
            for q in ("auto", "none")
        }
    packed_names = [f"{n}.weight" for n in packed_modules(models["auto"])]
    plain_state = models["none"].state_dict()
    plain_bytes = sum(plain_state[n].nbytes for n in packed_names)
    result = {
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "dense_fp8": dense_fp8_bytes(models["auto"]) | {"dequantised_bytes": plain_bytes},
        "rows": [],
    }
    for batch in batches:
        engines = {q: _engine(m, batch, steps) for q, m in models.items()}
        times: dict[str, list[tuple[float, float]]] = {q: [] for q in engines}
        with torch.no_grad():
            for _ in range(steps):
                for q, engine in engines.items():
                    times[q].append(_step_s(engine))
        for engine in engines.values():
            engine.close()
        med = {q: statistics.median(w for w, _ in t) * 1e3 for q, t in times.items()}
        cpu = {q: statistics.median(c for _, c in t) * 1e3 for q, t in times.items()}
        row = {
            "batch": batch,
            "packed_ms": med["auto"],
            "dequantised_ms": med["none"],
            "ratio": med["auto"] / med["none"],
            "packed_cpu_ms": cpu["auto"],
            "dequantised_cpu_ms": cpu["none"],
            "cpu_ratio": cpu["auto"] / cpu["none"],
        }
        result["rows"].append(row)
        print(
            f"batch {batch}: packed {row['packed_ms']:.2f} ms, dequantised "
            f"{row['dequantised_ms']:.2f} ms, ratio {row['ratio']:.2f} (median of {steps}); "
            f"CPU time {row['packed_cpu_ms']:.2f} / {row['dequantised_cpu_ms']:.2f} ms, "
            f"ratio {row['cpu_ratio']:.2f}"
        )
    d = result["dense_fp8"]
    print(
        f"dense FP8 linears: {d['linears']}, packed {d['bytes']} B, "
        f"dequantised ({dtype}) {d['dequantised_bytes']} B"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/packed_bench.json")
    args = parser.parse_args(argv)
    result = run(args.dtype, args.batch, args.steps)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
