"""Streaming-load benchmark: peak host memory and GB/s of ``load_checkpoint``.

    python bench/load_bench.py [--gb 2] [--shard-gb 0.5] [--dtype bfloat16] [--json out.json]

Writes a synthetic checkpoint in the official topology (``synthetic_config``:
``ModelConfig.tiny()``'s layer kinds with more experts, wider layers and larger
Engram tables, scaled to ``--gb``) to a temporary directory, loads it in a
fresh interpreter, prints the load's peak RSS against its bound and the load
throughput, then deletes the checkpoint.

The checkpoint is written straight from the model's shapes (a ``meta`` model,
nothing dense is ever built): FP8 E4M3 blocks for the projections, MXFP4 pairs
for the routed experts, FP8 rows for the Engram tables, each with E8M0 scales,
BF16/FP32 for the rest; random bytes, finite values.

The bound (docs/BENCHMARKS.md): peak RSS <= 1.3 x the largest shard + the model's resident
bytes (parameters and buffers after the load) + the interpreter's RSS just
before the load (torch and the engine imported). The shard term is the one
shard mapped at a time; 0.3 of it covers the slice temporaries.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from safetensors.torch import save_file  # noqa: E402

from engine.loader.checkpoint import empty_model  # noqa: E402
from engine.loader.files import INDEX_FILE  # noqa: E402
from engine.loader.formats import stored_shapes  # noqa: E402
from engine.model.deepseek_v41.config import ModelConfig, engram_table_primes  # noqa: E402
from engine.model.deepseek_v41.weight_names import WEIGHTS  # noqa: E402
from engine.model.weights import WeightFormat, scale_name  # noqa: E402

SHARD_SLACK = 1.3  # peak RSS allowance per byte of the largest shard

# Shares of the stored bytes, roughly the release's: routed experts most, then
# the two Engram tables; the rest (embed, head, attention) is what is left.
EXPERT_SHARE = 0.55
ENGRAM_SHARE = 0.30


def _base(experts: int, engram_vocab: int) -> ModelConfig:
    tiny = ModelConfig.tiny()
    rows = [
        sum(p)
        for p in engram_table_primes(
            engram_vocab, len(tiny.engram_layer_ids), tiny.engram_orders, tiny.engram_n_heads
        )
    ]
    return tiny.replace(
        vocab_size=32768,
        hidden_size=512,
        moe_intermediate_size=512,
        n_routed_experts=experts,
        engram_vocab_size=engram_vocab,
        engram_num_embeddings=rows,
    )


def _stored(name: str, shape: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The stored tensors of one model tensor: name -> (dtype, shape)."""
    fmt = WEIGHTS.format_of(name)
    if fmt is None:
        raise ValueError(f"{name} has no storage format")
    weight_shape, scale_shape = stored_shapes(fmt, shape)
    if fmt is WeightFormat.BF16:
        return {name: (torch.bfloat16, weight_shape)}
    if fmt is WeightFormat.FP32:
        return {name: (torch.float32, weight_shape)}
    assert scale_shape is not None
    weight_dtype = torch.int8 if fmt is WeightFormat.MXFP4 else torch.float8_e4m3fn
    return {name: (weight_dtype, weight_shape), scale_name(name): (torch.uint8, scale_shape)}


def stored_layout(config: ModelConfig) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """Every stored tensor of ``config``'s checkpoint, in the model's order."""
    model = empty_model(config, dtype=torch.bfloat16, device="meta")
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, tensor in model.state_dict().items():
        layout |= _stored(name, tuple(tensor.shape))
    return layout


def _nbytes(entry: tuple[torch.dtype, tuple[int, ...]]) -> int:
    dtype, shape = entry
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def layout_bytes(config: ModelConfig) -> int:
    return sum(_nbytes(e) for e in stored_layout(config).values())


def synthetic_config(target_bytes: int) -> ModelConfig:
    """The official topology scaled so that its checkpoint holds about ``target_bytes``."""
    b0 = layout_bytes(_base(8, 1000))
    per_expert = (layout_bytes(_base(16, 1000)) - b0) / 8
    per_vocab = (layout_bytes(_base(8, 101_000)) - b0) / 100_000
    experts = max(8, round(EXPERT_SHARE * target_bytes / per_expert))
    vocab = max(1000, round(ENGRAM_SHARE * target_bytes / per_vocab))
    # The fixed part (embed, head, attention) comes on top: scale both down to the target.
    fit = target_bytes / layout_bytes(_base(experts, vocab))
    return _base(max(8, round(experts * fit)), max(1000, round(vocab * fit)))


def _random(name: str, dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator):
    """Random stored bytes that decode to finite values."""
    if name.endswith(".scale"):  # E8M0: 2^-12 .. 2^-8
        raw = torch.randint(115, 120, shape, dtype=torch.uint8, generator=gen)
        return raw.view(torch.float8_e8m0fnu)
    if dtype is torch.int8:  # two E2M1 codes per byte: every byte is valid
        return torch.empty(shape, dtype=torch.uint8).random_(generator=gen).view(torch.int8)
    if dtype is torch.float8_e4m3fn:  # clear bit 0: never the NaN codes 0x7F / 0xFF
        raw = torch.empty(shape, dtype=torch.uint8).random_(generator=gen) & 0xFE
        return raw.view(torch.float8_e4m3fn)
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def write_synthetic(out_dir: Path, config: ModelConfig, shard_bytes: int, seed: int = 0) -> Path:
    """Write ``config``'s checkpoint as random stored bytes, one shard in memory at a time.

    A weight and its scale share a shard; a shard closes once it passes
    ``shard_bytes`` (the names of the release's ``model-0000N-of-0000M``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    groups: list[list[str]] = [[]]
    used = 0
    layout = stored_layout(config)
    for name, entry in layout.items():
        if name.endswith(".scale"):  # follows its weight
            groups[-1].append(name)
            used += _nbytes(entry)
            continue
        if groups[-1] and used >= shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += _nbytes(entry)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: _random(n, *layout[n], gen) for n in names}
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map |= dict.fromkeys(names, file)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


# ----------------------------------------------------------------- measuring


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(checkpoint: Path, dtype: str, progress: bool) -> dict[str, Any]:
    """Load ``checkpoint`` in this process; its peak RSS against the bound. Run in a fresh
    interpreter: the peak (VmHWM) counts from the process start."""
    import logging

    from engine.loader.checkpoint import load_checkpoint

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("engine.loader.weight_stream").setLevel(logging.INFO)
    torch.set_num_threads(1)
    baseline = _status_bytes("VmRSS")
    started = time.perf_counter()
    _, model = load_checkpoint(checkpoint, dtype=getattr(torch, dtype), progress=progress)
    seconds = time.perf_counter() - started
    peak = _status_bytes("VmHWM")
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in model.state_dict().values()
    }
    resident = sum(storages.values())
    shards = [f.stat().st_size for f in checkpoint.glob("*.safetensors")]
    index = json.loads((checkpoint / INDEX_FILE).read_text())
    data = index["metadata"]["total_size"]
    bound = SHARD_SLACK * max(shards) + resident + baseline
    return {
        "checkpoint_bytes": data,
        "shards": len(shards),
        "largest_shard_bytes": max(shards),
        "resident_bytes": resident,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak,
        "bound_bytes": bound,
        "within_bound": peak <= bound,
        "peak_over_baseline_and_model": (peak - baseline - resident) / max(shards),
        "seconds": seconds,
        "gb_per_s": data / 1e9 / seconds,
    }


def run_child(checkpoint: Path, dtype: str, progress: bool) -> tuple[dict[str, Any], str]:
    """``measure`` in a fresh interpreter: (its result, its stderr)."""
    cmd = [sys.executable, __file__, "--measure", str(checkpoint), "--dtype", dtype]
    if progress:
        cmd.append("--progress")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"measuring child failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="checkpoint size, GB (1e9 B)")
    parser.add_argument("--shard-gb", type=float, default=None, help="default: a quarter")
    parser.add_argument("--dtype", default="bfloat16", help="the loaded parameters' dtype")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary dir")
    parser.add_argument("--json", type=Path, default=None, help="write the result here")
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--progress", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a shared machine; the load itself runs on one thread too
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.dtype, args.progress)))
        return 0
    target = int(args.gb * 1e9)
    shard = int((args.shard_gb or args.gb / 4) * 1e9)
    config = synthetic_config(target)
    tmp = Path(tempfile.mkdtemp(prefix="load_bench-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        write_synthetic(tmp / "ckpt", config, shard)
        print(
            f"wrote {config.n_routed_experts} experts x {config.num_hidden_layers} layers, "
            f"Engram rows {config.engram_num_embeddings} in {time.perf_counter() - t0:.1f} s"
        )
        result, stderr = run_child(tmp / "ckpt", args.dtype, progress=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = [line for line in stderr.splitlines() if "engine.loader.weight_stream" in line]
    print("\n".join(summary))
    result |= {"dtype": args.dtype, "config": {"n_routed_experts": config.n_routed_experts}}
    for key, value in result.items():
        print(f"{key}: {value / 1e6:.1f} MB" if key.endswith("_bytes") else f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["within_bound"] else 1


if __name__ == "__main__":
    sys.exit(main())
