"""One MoE layer at the tiny model's dims: the fused routed experts vs the old per-expert loop.

The old layout (one ``Expert`` module, three ``nn.Linear``, per routed expert,
a Python loop with a ``torch.where`` and an ``index_add_`` per active expert)
lives on only here, as ``LoopMoE``: the baseline of this benchmark and the
oracle of tests/engine/model/deepseek_v41/test_moe.py. Timed, per batch (decode rows):

- ``loop``: ``LoopMoE`` (fp32 weights);
- ``fused``: ``MoE`` with stacked fp32 experts (``quantization="none"``);
- ``fused_packed``: ``MoE`` with the experts' MXFP4 bytes (the served path:
  activations quantised to E4M3, one expert's weight dequantised at a time).

Then the whole tiny model (``make_tiny``, in a temporary directory) on
``--tokens`` tokens: loaded with packed experts (``quantization="auto"``) vs
dequantised at load (``"none"``); only the routed experts differ.

Medians of ``--repeats`` calls after a warm-up, the three variants timed in
turn call by call (a shared machine's load then weighs on each alike), one thread.

    .venv/bin/python bench/moe_bench.py        # writes bench/results/moe_bench.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.model.deepseek_v41.config import ModelConfig  # noqa: E402
from engine.model.deepseek_v41.moe import Expert, MoE  # noqa: E402
from engine.model.precision import compute_dtype, upcast  # noqa: E402


class LoopMoE(nn.Module):
    """The MoE layer as it was before the experts were stacked (same router, same shared expert)."""

    def __init__(self, moe: MoE) -> None:
        super().__init__()
        routed = moe.experts
        self.n_routed_experts = routed.n_experts
        self.gate = moe.gate
        self.shared_experts = moe.shared_experts
        self.experts = nn.ModuleList()
        for e in range(routed.n_experts):
            expert = Expert(routed.dim, routed.inter_dim, routed.swiglu_limit)
            expert.to(device=routed.w1.device, dtype=routed.w1.dtype)
            with torch.no_grad():
                for name in ("w1", "w2", "w3"):
                    getattr(expert, name).weight.copy_(getattr(routed, name)[e])
            self.experts.append(expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x)
        y = torch.zeros(x.shape, dtype=compute_dtype(x), device=x.device)
        counts = torch.bincount(idx.flatten(), minlength=self.n_routed_experts).tolist()
        for e, count in enumerate(counts):
            if count == 0:
                continue
            token, slot = torch.where(idx == e)
            out = self.experts[e](x[token], weights[token, slot, None])
            y.index_add_(0, token, upcast(out))
        y += upcast(self.shared_experts(x))
        return y.to(x.dtype)


def _medians_ms(modules: dict[str, nn.Module], x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median time per call of each module, measured round-robin (call by call, in turn)
    so that a shared machine's changing load weighs on every variant alike."""
    for module in modules.values():
        for _ in range(5):
            module(x)
    times: dict[str, list[float]] = {label: [] for label in modules}
    for _ in range(repeats):
        for label, module in modules.items():
            start = time.perf_counter()
            module(x)
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t) * 1e3 for label, t in times.items()}


def run(batches: list[int], repeats: int, seed: int = 0) -> dict:
    config = ModelConfig.tiny()
    torch.manual_seed(seed)
    fused = MoE(config).eval()
    with torch.no_grad():
        for p in fused.parameters():
            p.normal_(0.0, config.initializer_range)
    loop = LoopMoE(fused).eval()
    packed = MoE(config).eval()
    packed.load_state_dict(fused.state_dict())
    packed.experts = fused.experts.packed_copy()
    rows = []
    with torch.inference_mode():
        for batch in batches:
            x = torch.randn(
                batch, config.hidden_size, generator=torch.Generator().manual_seed(batch)
            )
            row: dict[str, float] = {"batch": batch}
            medians = _medians_ms(
                {"loop": loop, "fused": fused, "fused_packed": packed}, x, repeats
            )
            for label, ms in medians.items():
                row[f"{label}_ms"] = round(ms, 4)
            row["fused_vs_loop"] = round(row["loop_ms"] / row["fused_ms"], 3)
            row["packed_vs_loop"] = round(row["loop_ms"] / row["fused_packed_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return {
        "dims": {
            "hidden_size": config.hidden_size,
            "moe_intermediate_size": config.moe_intermediate_size,
            "n_routed_experts": config.n_routed_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
        },
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "rows": rows,
    }


def run_model(tokens: list[int], repeats: int) -> list[dict]:
    """Forward of the tiny checkpoint, packed experts vs dequantised, timed in turn."""
    if not tokens:
        return []
    from engine.loader.checkpoint import load_checkpoint
    from engine.loader.checkpoint_writer import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny(Path(tmp) / "tiny")
        models = {
            "packed": load_checkpoint(path)[1].eval(),
            "dequantised": load_checkpoint(path, quantization="none")[1].eval(),
        }
    rows = []
    with torch.inference_mode():
        for n in tokens:
            ids = torch.randint(0, 120_000, (n,), generator=torch.Generator().manual_seed(n))
            medians = _medians_ms(models, ids, repeats)
            row = {"tokens": n, **{f"{k}_ms": round(v, 2) for k, v in medians.items()}}
            row["packed_over_dequantised"] = round(medians["packed"] / medians["dequantised"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--tokens", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--model-repeats", type=int, default=15)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "moe_bench.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args.batch, args.repeats)
    result["model_forward"] = run_model(args.tokens, args.model_repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
