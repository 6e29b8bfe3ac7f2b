"""GPU smoke test: the kernel benchmark, then the tiny model on the GPU against the CPU.

    python bench/gpu_smoke.py [--device cuda] [--json bench/results/gpu_smoke.json]

One command for a machine with a GPU (docs/design/kernels.md):

1. ``bench/gpu_kernels.py``: every Triton kernel against its PyTorch reference on
   the GPU, and their timings (skipped, and said so, without CUDA);
2. the tiny checkpoint (``make_tiny``, the model ``flashserve serve --model tiny``
   serves) through the engine on ``--device`` and on the CPU, greedy, the same
   prompts: tokens and per-step logits compared. fp32 on two devices rounds
   GEMMs differently, and a value on an FP4/FP8 rounding boundary can then take
   the next code (docs/design/semantics.md), so a differing token after a near
   tie is reported, not failed; the run fails (exit 1) when a kernel disagrees
   with its reference or when the first step's logits differ by more than 0.1.

3. ``bench/cuda_graph_bench.py``: decode step time eager vs CUDA graphs at
   batch 1, 8 and 32 and their greedy tokens (fails when they differ; skipped
   without CUDA).

With ``--device cpu`` step 2 compares the CPU with itself (the CI check of this
script). Weights load as ``load_checkpoint`` defaults (``quantization="auto"``: the
FP8 linears and MXFP4 experts stay packed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
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

FIRST_STEP_LIMIT = 0.1  # |dlogit| of the first step (the prefill's output) that fails the run


def run_kernels(out: Path) -> dict:
    if not torch.cuda.is_available():
        print("1. kernels: no CUDA device, bench/gpu_kernels.py skipped")
        return {"ran": False}
    cmd = [sys.executable, str(REPO / "bench" / "gpu_kernels.py"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print("1. kernels:\n" + proc.stdout + proc.stderr)
    return {"ran": True, "returncode": proc.returncode, "json": str(out)}


def run_cuda_graphs(out: Path) -> dict:
    """Step 3: ``bench/cuda_graph_bench.py`` (decode step eager vs CUDA graphs, batch 1/8/32)."""
    if not torch.cuda.is_available():
        print("3. cuda graphs: no CUDA device, bench/cuda_graph_bench.py skipped")
        return {"ran": False}
    cmd = [sys.executable, str(REPO / "bench" / "cuda_graph_bench.py"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print("3. cuda graphs:\n" + proc.stdout + proc.stderr)
    return {"ran": True, "returncode": proc.returncode, "json": str(out)}


def greedy_run(checkpoint: Path, device: str, prompts: list[list[int]], steps: int) -> dict:
    """Tokens and per-step logits of each prompt, greedy, through the engine on ``device``."""
    _, model = load_checkpoint(checkpoint, device=device)
    logits: dict[str, list[torch.Tensor]] = {}

    class Recorder:
        def __init__(self, inner) -> None:
            self.inner = inner

        def execute(self, batch):
            out = self.inner.execute(batch)
            for seq in batch.sampled():
                logits.setdefault(seq.request_id, []).append(out[seq.seq_id].float().cpu())
            return out

        def release(self, seq) -> None:
            self.inner.release(seq)

    config = EngineConfig(device=device, kv_cache_bytes=64 << 20)
    engine = engine_for_model(
        config, model.eval(), tokenizer=load_tokenizer(checkpoint / "tokenizer.json")
    )
    engine.runner = Recorder(engine.runner)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(Request(f"p{i}", ids, params))
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens.setdefault(out.request_id, []).extend(c.token_ids)
    seconds = time.perf_counter() - t0
    engine.close()
    return {"tokens": tokens, "logits": logits, "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "gpu_smoke.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": args.device}
    result["kernels"] = run_kernels(args.json.with_name("gpu_kernels.json"))
    failed = result["kernels"].get("returncode", 0) != 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("2. engine: no CUDA device, skipped")
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        return int(failed)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120000, (n,), generator=gen).tolist() for n in (7, 64, 300)]
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny(Path(tmp) / "tiny", seed=0)
        cpu = greedy_run(checkpoint, "cpu", prompts, args.steps)
        dev = greedy_run(checkpoint, args.device, prompts, args.steps)
    rows = []
    for rid in cpu["tokens"]:
        same = sum(a == b for a, b in zip(cpu["tokens"][rid], dev["tokens"][rid], strict=True))
        first_diverging = next(
            (
                i
                for i, (a, b) in enumerate(zip(cpu["tokens"][rid], dev["tokens"][rid], strict=True))
                if a != b
            ),
            None,
        )
        diffs = [
            float((a - b).abs().max())
            for a, b in zip(cpu["logits"][rid], dev["logits"][rid], strict=False)
        ]
        rows.append(
            {
                "request": rid,
                "tokens_equal": same,
                "tokens": len(cpu["tokens"][rid]),
                "first_diverging_step": first_diverging,
                "first_step_max_dlogit": diffs[0],
                "max_dlogit_before_divergence": max(diffs[: first_diverging or len(diffs)]),
            }
        )
        failed |= diffs[0] > FIRST_STEP_LIMIT
    print(f"2. engine, tiny checkpoint, greedy {args.steps} tokens, {args.device} vs cpu:")
    for r in rows:
        print(
            f"   {r['request']}: {r['tokens_equal']}/{r['tokens']} tokens equal, first step "
            f"max |dlogit| {r['first_step_max_dlogit']:.2e}, before any divergence "
            f"{r['max_dlogit_before_divergence']:.2e}"
        )
    print(f"   engine seconds: cpu {cpu['seconds']:.2f}, {args.device} {dev['seconds']:.2f}")
    result["engine"] = {
        "rows": rows,
        "cpu_seconds": cpu["seconds"],
        "device_seconds": dev["seconds"],
    }
    result["cuda_graphs"] = run_cuda_graphs(args.json.with_name("cuda_graph_bench.json"))
    failed |= result["cuda_graphs"].get("returncode", 0) != 0
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}; {'FAILED' if failed else 'ok'}")
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
