"""Decode step time, eager vs CUDA graphs, on the tiny checkpoint; greedy tokens compared.

    python bench/cuda_graph_bench.py [--device cuda] [--batches 1,8,32] [--json PATH]

For each batch size B: B greedy requests through two engines over the same
model, one with ``enforce_eager=True`` and one with decode graphs captured for
B (engine/runner/cuda_graphs.py); the mean time of the decode-only steps (the first
two of each run left out) and the capture time are printed. Exit 1 when any
request's tokens differ between the two: a batch of exactly a bucket's size has
no padding, so both paths run the same kernels on the same shapes.

``--backend record`` (CPU) swaps the CUDA backend for the recording one
(engine/runner/graph_capture.py): the CI check of this script, not a speed figure.
``bench/gpu_smoke.py`` runs this script on CUDA (docs/design/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.api.request import Request  # noqa: E402
from engine.api.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.loader.builder import engine_for_model  # noqa: E402
from engine.loader.checkpoint import load_checkpoint  # noqa: E402
from engine.loader.checkpoint_writer import make_tiny  # noqa: E402
from engine.loader.tokenizer import load_tokenizer  # noqa: E402
from engine.runner.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.runner.graph_capture import RecordingGraphBackend  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(model, tokenizer, device: str, batch: int, steps: int, graphs: str | None) -> dict:
    """Tokens per request and decode-step times of one engine (``graphs``: None = eager,
    "cuda" = captured by the engine, "record" = the CPU recording backend)."""
    config = EngineConfig(
        device=device,
        kv_cache_bytes=64 << 20,
        max_num_seqs=batch,
        enforce_eager=graphs != "cuda",
        cuda_graph_sizes=(batch,),
    )
    engine = engine_for_model(config, model, tokenizer=tokenizer)
    runner = engine.runner
    if graphs == "record":
        backend = RecordingGraphBackend([*model.parameters(), *model.buffers()])
        runner.graphs = DecodeGraphs(model, (batch,), backend, torch.device(device))
        runner.graphs.capture()
    captured = runner.graphs
    if graphs is not None and captured is None:
        raise RuntimeError(f"no graphs were captured on {device}")
    times: list[float] = []
    execute = runner.execute

    def timed(step_batch):
        _sync(device)
        t0 = time.perf_counter()
        out = execute(step_batch)
        _sync(device)
        if not step_batch.prefills and len(step_batch.decodes) == batch:
            times.append(time.perf_counter() - t0)
        return out

    runner.execute = timed
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, 120000, (16 + i,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", ids, params))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens.setdefault(out.request_id, []).extend(c.token_ids)
    engine.close()
    kept = times[2:] or times
    return {
        "tokens": tokens,
        "decode_step_ms": 1e3 * sum(kept) / max(1, len(kept)),
        "decode_steps_timed": len(kept),
        "graph_steps": captured.steps if captured is not None else 0,
        "capture_seconds": captured.capture_seconds if captured is not None else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=32, help="tokens per request")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quantization", default="auto", choices=("auto", "none"))
    ap.add_argument("--backend", default="cuda", choices=("cuda", "record"))
    ap.add_argument(
        "--json", type=Path, default=REPO / "bench" / "results" / "cuda_graph_bench.json"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.backend == "cuda" and not torch.cuda.is_available():
        print("cuda_graph_bench: no CUDA device (use --device cpu --backend record on a CPU)")
        return 1
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny(Path(tmp) / "tiny", seed=0)
        tokenizer = load_tokenizer(checkpoint / "tokenizer.json")
        _, model = load_checkpoint(
            checkpoint,
            device=args.device,
            dtype=getattr(torch, args.dtype),
            quantization=args.quantization,
        )
        model = model.eval()
        for b in batches:
            try:
                eager = run(model, tokenizer, args.device, b, args.steps, None)
                graph = run(model, tokenizer, args.device, b, args.steps, args.backend)
            except Exception:  # one batch's failure is reported; the others still run
                print(f"batch {b:3d}: FAILED\n{traceback.format_exc()}", flush=True)
                failed = True
                continue
            equal = sum(eager["tokens"][r] == graph["tokens"][r] for r in eager["tokens"])
            failed |= equal != b
            row = {
                "batch": b,
                "eager_step_ms": eager["decode_step_ms"],
                "graph_step_ms": graph["decode_step_ms"],
                "speedup": eager["decode_step_ms"] / max(graph["decode_step_ms"], 1e-9),
                "requests_with_equal_tokens": equal,
                "requests": b,
                "graph_steps": graph["graph_steps"],
                "capture_seconds": graph["capture_seconds"],
            }
            rows.append(row)
            print(
                f"batch {b:3d}: decode step eager {row['eager_step_ms']:8.2f} ms, graphs "
                f"{row['graph_step_ms']:8.2f} ms ({row['speedup']:.2f}x), capture "
                f"{row['capture_seconds']:.1f} s, tokens equal {equal}/{b}"
            )
    result = {
        "device": args.device,
        "backend": args.backend,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "steps": args.steps,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}; {'FAILED' if failed else 'ok'}")
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
