"""GPU smoke test: the kernel benchmark, then the tiny model on the GPU against the CPU.

    python bench/gpu_smoke.py [--device cuda] [--json bench/results/gpu_smoke.json]

One command for a machine with a GPU (docs/design/kernels.md):

1. ``bench/gpu_kernels.py``: every Triton kernel against its PyTorch reference on
   the GPU, and their timings (skipped, and said so, without CUDA);
2. the tiny checkpoint (``make_tiny``, the model ``flashserve serve --model tiny``
   serves) through the engine on ``--device`` and on the CPU, greedy, the same
   prompts, in three passes: the CPU, the device with the PyTorch reference ops
   (``FLASHSERVE_KERNELS=reference``) and the device with the Triton kernels.
   Tokens and per-step logits are compared pairwise. fp32 on two devices rounds
   GEMMs differently, and a value on an FP4/FP8 rounding boundary or an indexer
   near tie can then take the next code or entry (docs/design/semantics.md), so
   a differing token is reported, not failed; the run fails (exit 1) when a kernel
   disagrees with its reference, or when the Triton pass's first-step logits stray
   from the device reference pass's by more than 2% of the largest logit.

3. ``bench/cuda_graph_bench.py``: decode step time eager vs CUDA graphs at
   batch 1, 8 and 32 and their greedy tokens (fails when they differ; skipped
   without CUDA).

With ``--device cpu`` step 2 compares the CPU with itself (the CI check of this
script). Weights load as ``load_checkpoint`` defaults (``quantization="auto"``: the
FP8 linears and MXFP4 experts stay packed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
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
from kernels.dispatch import ENV_VAR, OPS, OPS_VAR  # noqa: E402

# The Triton pass's first-step (prefill output) deviation from the reference ops on
# the same device, over the largest logit, that fails the run. The kernels take bf16
# queries and windows (docs/design/kernels.md): about 2^-8 per attention, compounded
# over the layers; 2% leaves room for that and none for a wrong kernel.
FIRST_STEP_RELATIVE = 0.02
# Prompt lengths of step 2: the window alone, a window's worth, and past the
# compressor and the indexer's top-k (the tiny model's window is 16 tokens).
PROMPT_LENGTHS = (7, 64, 300)


def run_step(name: str, cmd: list[str], out: Path, timeout: float) -> dict:
    """One step as a child process under a time limit: a device lease is short, so a
    step that hangs (a kernel compiling forever, say) is cut and reported, and the
    steps after it still run. The child's output streams through as it comes."""
    print(f"{name}:", flush=True)
    try:
        proc = subprocess.run(cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{name}: cut after {timeout:.0f} s", flush=True)
        return {"ran": True, "returncode": 124, "json": str(out)}
    return {"ran": True, "returncode": proc.returncode, "json": str(out)}


def run_kernels(out: Path, timeout: float) -> dict:
    if not torch.cuda.is_available():
        print("1. kernels: no CUDA device, bench/gpu_kernels.py skipped")
        return {"ran": False}
    cmd = [sys.executable, str(REPO / "bench" / "gpu_kernels.py"), "--json", str(out)]
    return run_step("1. kernels", cmd, out, timeout)


def run_cuda_graphs(out: Path, timeout: float) -> dict:
    """Step 3: ``bench/cuda_graph_bench.py`` (decode step eager vs CUDA graphs, batch 1/8/32)."""
    if not torch.cuda.is_available():
        print("3. cuda graphs: no CUDA device, bench/cuda_graph_bench.py skipped")
        return {"ran": False}
    cmd = [sys.executable, str(REPO / "bench" / "cuda_graph_bench.py"), "--json", str(out)]
    return run_step("3. cuda graphs", cmd, out, timeout)


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


@contextlib.contextmanager
def kernel_env(mode: str, ops: str | None = None) -> Iterator[None]:
    """``FLASHSERVE_KERNELS=mode`` (and ``FLASHSERVE_TRITON_OPS=ops``, else unset) for one
    pass; kernels/dispatch.py reads both on every call."""
    saved = {name: os.environ.get(name) for name in (ENV_VAR, OPS_VAR)}
    os.environ[ENV_VAR] = mode
    os.environ.pop(OPS_VAR, None)
    if ops is not None:
        os.environ[OPS_VAR] = ops
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def step_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    """Step 2's prompts: seeded random ids of the given lengths."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 120000, (n,), generator=gen).tolist() for n in lengths]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def compare(rid: str, base: dict, other: dict) -> dict:
    """How far ``other``'s greedy run strays from ``base``'s for one request."""
    tokens_a, tokens_b = base["tokens"][rid], other["tokens"][rid]
    diverging = first_divergence(tokens_a, tokens_b)
    pairs = list(zip(base["logits"][rid], other["logits"][rid], strict=False))
    diffs = [float((a - b).abs().max()) for a, b in pairs]
    return {
        "tokens_equal": sum(x == y for x, y in zip(tokens_a, tokens_b, strict=True)),
        "first_diverging_step": diverging,
        "first_step_max_dlogit": diffs[0],
        # The first step's deviation over its largest logit: a bf16 kernel's share
        # shows as a fraction of the logits' scale, whatever that scale is.
        "first_step_relative": diffs[0] / max(float(pairs[0][0].abs().max()), 1e-30),
        "max_dlogit_before_divergence": max(diffs[: diverging or len(diffs)]),
    }


def run_engine(device: str, steps: int, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> dict:
    """Step 2: the tiny checkpoint greedy on the CPU and twice on ``device``: once with
    the PyTorch reference ops, once with the Triton kernels (``auto``). The CPU
    against the device reference is GEMM rounding alone; the device reference
    against the Triton pass is the kernels' own share."""
    prompts = step_prompts(lengths)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny(Path(tmp) / "tiny", seed=0)
        cpu = greedy_run(checkpoint, "cpu", prompts, steps)
        with kernel_env("reference"):
            ref = greedy_run(checkpoint, device, prompts, steps)
        with kernel_env("auto"):
            dev = greedy_run(checkpoint, device, prompts, steps)
    rows = []
    for rid in cpu["tokens"]:
        rows.append(
            {
                "request": rid,
                "prompt_tokens": len(prompts[int(rid[1:])]),
                "tokens": len(cpu["tokens"][rid]),
                "device_reference_vs_cpu": compare(rid, cpu, ref),
                "device_triton_vs_cpu": compare(rid, cpu, dev),
                "device_triton_vs_device_reference": compare(rid, ref, dev),
            }
        )
    print(f"2. engine, tiny checkpoint, greedy {steps} tokens on {device} and the cpu:")
    for r in rows:
        print(f"   {r['request']} ({r['prompt_tokens']} prompt tokens):")
        for name in ("device_reference_vs_cpu", "device_triton_vs_cpu"):
            c = r[name]
            print(
                f"     {name:<36} {c['tokens_equal']}/{r['tokens']} tokens equal, first step "
                f"max |dlogit| {c['first_step_max_dlogit']:.2e} "
                f"({c['first_step_relative']:.1e} of max |logit|), before any divergence "
                f"{c['max_dlogit_before_divergence']:.2e}"
            )
        c = r["device_triton_vs_device_reference"]
        print(
            f"     {'device_triton_vs_device_reference':<36} {c['tokens_equal']}/{r['tokens']} "
            f"tokens equal, first step max |dlogit| {c['first_step_max_dlogit']:.2e} "
            f"({c['first_step_relative']:.1e} of max |logit|)"
        )
    print(
        f"   engine seconds: cpu {cpu['seconds']:.2f}, {device} reference {ref['seconds']:.2f}, "
        f"{device} triton {dev['seconds']:.2f} (the first Triton pass compiles its kernels)"
    )
    return {
        "rows": rows,
        "cpu_seconds": cpu["seconds"],
        "device_reference_seconds": ref["seconds"],
        "device_seconds": dev["seconds"],
    }


def attribute(device: str, steps: int, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> dict:
    """``--attribute``: the tiny checkpoint on ``device`` with the reference ops, then
    once per Triton op with only that op on Triton (``FLASHSERVE_TRITON_OPS``): each
    op's own share of the Triton pass's deviation, per prompt."""
    prompts = step_prompts(lengths)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = make_tiny(Path(tmp) / "tiny", seed=0)
        with kernel_env("reference"):
            ref = greedy_run(checkpoint, device, prompts, steps)
        for op in OPS:
            try:
                with kernel_env("auto", ops=op):
                    run = greedy_run(checkpoint, device, prompts, steps)
            except Exception:
                print(f"   {op}: FAILED\n{traceback.format_exc()}", flush=True)
                out[op] = {"error": traceback.format_exc(limit=3)}
                continue
            out[op] = {rid: compare(rid, ref, run) for rid in ref["tokens"]}
            cells = ", ".join(
                f"{rid} {c['first_step_max_dlogit']:.1e} ({c['first_step_relative']:.1e})"
                for rid, c in out[op].items()
            )
            print(f"   only {op:<18} on Triton, first step max |dlogit| (of max |logit|): {cells}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument(
        "--step-timeout", type=float, default=240.0, help="seconds for step 1 and for step 3"
    )
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "gpu_smoke.json")
    ap.add_argument(
        "--prompt-lengths",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=PROMPT_LENGTHS,
        help="comma-separated prompt lengths of step 2 (default 7,64,300)",
    )
    ap.add_argument(
        "--attribute",
        action="store_true",
        help="only step 2's attribution: one pass per Triton op, the rest on the reference",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.attribute:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        print(
            f"2. attribution on {args.device}, the device reference pass against one op at a time:"
        )
        args.json.write_text(
            json.dumps(attribute(args.device, args.steps, args.prompt_lengths), indent=2) + "\n"
        )
        return 0
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": args.device}
    result["kernels"] = run_kernels(args.json.with_name("gpu_kernels.json"), args.step_timeout)
    failed = result["kernels"].get("returncode", 0) != 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("2. engine: no CUDA device, skipped")
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        return int(failed)
    try:
        result["engine"] = run_engine(args.device, args.steps, args.prompt_lengths)
        failed |= any(
            r["device_triton_vs_device_reference"]["first_step_relative"] > FIRST_STEP_RELATIVE
            for r in result["engine"]["rows"]
        )
    except Exception:
        print(f"2. engine: FAILED\n{traceback.format_exc()}", flush=True)
        result["engine"] = {"error": traceback.format_exc(limit=3)}
        failed = True
    result["cuda_graphs"] = run_cuda_graphs(
        args.json.with_name("cuda_graph_bench.json"), args.step_timeout
    )
    failed |= result["cuda_graphs"].get("returncode", 0) != 0
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}; {'FAILED' if failed else 'ok'}")
    return int(failed)


if __name__ == "__main__":
    raise SystemExit(main())
