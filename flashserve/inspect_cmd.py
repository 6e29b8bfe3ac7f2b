"""``flashserve inspect``: parameter and KV byte accounting of a config or checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.model.weights import WeightRules

NAME = "inspect"
HELP = (
    "print the context length (max_model_len), parameter counts, KV bytes and layer roles "
    "of a config or checkpoint; "
    "--plan: its memory plan on N devices"
)

_SUMMARY = (
    "max_model_len",
    "params_total",
    "params_backbone",
    "params_engram",
    "params_active_prefill",
    "params_active_decode",
    "global_kv_bytes_per_token",
    "persistent_kv_bytes_per_token",
    "swa_kv_bytes_per_request",
    "params_vision",
    "params_dspark",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="`tiny`, `official`, a config.json, or a checkpoint directory"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    plan = parser.add_argument_group("memory plan (engine/planning/memory_plan.py)")
    plan.add_argument(
        "--plan",
        action="store_true",
        help="print the memory plan instead: weight bytes per device by kind (packed, as "
        "the release stores them), Engram host bytes, the activation reserve, the global-KV "
        "pool and its capacity in tokens",
    )
    plan.add_argument(
        "--devices",
        type=int,
        default=None,
        help="devices to plan for, all nodes together (default: tensor x data parallel "
        "size, else 1); given alone, N > 1 plans --data-parallel-size N with "
        "--enable-expert-parallel",
    )
    plan.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="T: query heads, wo_a/wo_b groups and the shared expert split T ways, the "
        "latent KV replicated on each of the T ranks (default 1)",
    )
    plan.add_argument(
        "--data-parallel-size",
        type=int,
        default=None,
        help="D: groups of T ranks, each serving its own sequences with its own KV pool "
        "(default: devices / T)",
    )
    plan.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="split the routed experts over all T x D ranks (E / world each); without it "
        "every rank holds all of them",
    )
    plan.add_argument(
        "--nnodes", type=int, default=1, help="nodes the devices are spread over (default 1)"
    )
    plan.add_argument(
        "--compare",
        action="store_true",
        help="print DP x EP and TP x EP side by side for --devices over --nnodes",
    )
    plan.add_argument(
        "--device-memory-gib",
        type=float,
        default=141.0,
        help="memory of each device in GiB (default %(default)s, an H200)",
    )
    plan.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="rows per engine step, sizing the activation reserve (default %(default)s)",
    )
    plan.add_argument(
        "--max-num-seqs",
        type=int,
        default=64,
        help="sequences at once, sizing logits and SWA KV (default %(default)s)",
    )
    plan.add_argument("--page-tokens", type=int, default=64, help="tokens per KV page")
    plan.add_argument("--kv-dtype", choices=("fp4", "bf16"), default="fp4")


def checkpoint_summary(
    path: Path, rules: WeightRules, serves_vision: bool = False
) -> dict[str, Any]:
    """What a checkpoint directory stores: tensors and bytes per dtype, the kinds
    its model's name rules ``rules`` skip (``serves_vision``: the model has a
    vision tower, which reads the vision tensors)."""
    from engine.loader.files import iter_checkpoint_tensors

    by_dtype: dict[str, dict[str, int]] = {}
    skipped: dict[str, int] = {}
    count = 0
    for tensor in iter_checkpoint_tensors(path):
        count += 1
        entry = by_dtype.setdefault(tensor.dtype, {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += tensor.nbytes
        kind = rules.skipped(tensor.name, serves_vision)
        if kind is not None:
            skipped[kind] = skipped.get(kind, 0) + 1
    return {
        "tensors": count,
        "bytes": sum(e["bytes"] for e in by_dtype.values()),
        "by_dtype": by_dtype,
        "skipped": skipped,
    }


def report(model: str) -> dict[str, Any]:
    """The JSON object ``inspect --json`` prints."""
    from engine.loader.files import INDEX_FILE, SINGLE_FILE
    from engine.model.deepseek_v41.config import ModelConfig
    from engine.model.deepseek_v41.vision.config import vision_config
    from engine.model.registry import spec_of
    from engine.planning.accounting import account

    config = ModelConfig.preset(model)
    out: dict[str, Any] = {
        "model": model,
        # What `serve` takes as its context without --max-model-len (and /v1/models reports).
        "max_model_len": config.max_position_embeddings,
        **account(config).to_dict(),
    }
    path = Path(model)
    if path.is_dir() and ((path / SINGLE_FILE).exists() or (path / INDEX_FILE).exists()):
        serves_vision = vision_config(config) is not None
        out["checkpoint"] = checkpoint_summary(path, spec_of(config).weights, serves_vision)
    return out


def _human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def format_report(data: dict[str, Any]) -> str:
    """A readable table of ``report``'s numbers and the per-layer roles."""
    lines = [f"model: {data['model']}  (CED boundary: layer {data['ced_boundary']})", ""]
    for key in _SUMMARY:
        lines.append(f"{key:<32}{data[key]:>20,}  ({_human(data[key])})")
    lines += [
        "",
        f"{'layer':>5} {'role':<9} {'ratio':>5} {'S(l)':>5} {'I(l)':>5} "
        f"{'engram':<6} {'stage':<8} {'params':>16} {'active':>16}",
    ]
    for row in data["layers"]:
        lines.append(
            f"{row['layer']:>5} {row['role']:<9} {row['compress_ratio']:>5} "
            f"{_dash(row['kv_source']):>5} {_dash(row['index_source']):>5} "
            f"{'yes' if row['engram'] else '':<6} {row['stage']:<8} "
            f"{row['params']:>16,} {row['params_active']:>16,}"
        )
    if "checkpoint" in data:
        ckpt = data["checkpoint"]
        lines += ["", f"checkpoint: {ckpt['tensors']} tensors, {ckpt['bytes']:,} bytes"]
        for dtype, entry in sorted(ckpt["by_dtype"].items()):
            lines.append(f"  {dtype:<8} {entry['tensors']:>8} tensors {entry['bytes']:>20,} bytes")
        for kind, count in sorted(ckpt["skipped"].items()):
            lines.append(f"  skipped when loading: {count} {kind} tensors")
    return "\n".join(lines)


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def plan_topology(args: argparse.Namespace) -> tuple[int, Any]:
    """(devices, ``Topology`` or None) from the plan flags; None: ``memory_plan``'s default."""
    from engine.planning.memory_plan import PlanError, Topology

    given = (
        args.tensor_parallel_size is not None
        or args.data_parallel_size is not None
        or args.enable_expert_parallel
        or args.nnodes != 1
    )
    if not given:
        return (1 if args.devices is None else args.devices), None
    tp = 1 if args.tensor_parallel_size is None else args.tensor_parallel_size
    if tp < 1:
        raise PlanError(f"--tensor-parallel-size must be >= 1, got {tp}")
    dp = args.data_parallel_size
    if dp is None:
        dp = 1 if args.devices is None else max(1, args.devices // tp)
    devices = tp * dp if args.devices is None else args.devices
    return devices, Topology(tp, dp, args.enable_expert_parallel, args.nnodes)


def plan_report(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """(the JSON object, the printed lines) of ``inspect --plan``."""
    from engine.model.deepseek_v41.config import ModelConfig
    from engine.planning.memory_plan import (
        GIB,
        compared_topologies,
        format_comparison,
        format_plan,
        memory_plan,
    )

    config = ModelConfig.preset(args.model)
    devices, topology = plan_topology(args)
    options = dict(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        page_tokens=args.page_tokens,
        kv_dtype=args.kv_dtype,
    )
    memory = int(args.device_memory_gib * GIB)
    if args.compare:
        plans = [
            memory_plan(config, devices, memory, topology=t, **options)
            for t in compared_topologies(devices, args.nnodes, config)
        ]
        from engine.planning.ep_traffic import ep_traffic_of, format_ep_traffic

        data: dict[str, Any] = {"model": args.model, "plans": [p.to_dict() for p in plans]}
        lines = format_comparison(plans)
        try:
            data["ep_traffic"] = asdict(ep_traffic_of(config, devices, args.nnodes))
        except ValueError:  # experts that do not split evenly: no table on paper
            return data, lines
        return data, [*lines, "", *format_ep_traffic(config, [(devices, args.nnodes)])]
    plan = memory_plan(config, devices, memory, topology=topology, **options)
    return {"model": args.model, **plan.to_dict()}, format_plan(plan)


def run(args: argparse.Namespace) -> int:
    if args.plan:
        from engine.planning.memory_plan import PlanError

        try:
            data, lines = plan_report(args)
        except (PlanError, ValueError) as exc:
            print(f"flashserve inspect: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(data, indent=2) if args.json else "\n".join(lines))
        return 0
    data = report(args.model)
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return 0
