"""Ablations: the same workload against servers launched with one design choice undone,
each metric reported as a ratio to the default server (``--compare``).

- ``disable-ced``: full-depth prefill instead of CED with bounded replay;
- ``kv-bf16``: global KV and index keys stored in bf16 instead of FP4;
- ``no-ssd``: no persistent tier (the default server gets a fresh ``--kv-dir``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.serving.driver import RunResult
from bench.serving.launch import LaunchedServer, ServerSpec

BASELINE = "default"

# Rows of the terminal table; every numeric metric is in the JSON.
HEADLINE = (
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "mean_e2el_ms",
    "cache_hit_token_share",
    "request_goodput",
)
HEADLINE_COUNTERS = ("replay_tokens", "preemptions")


@dataclass(frozen=True, slots=True)
class Variant:
    label: str
    args: tuple[str, ...] = ()
    ssd: bool = True


VARIANTS = (
    Variant(BASELINE),
    Variant("disable-ced", ("--disable-ced",)),
    Variant("kv-bf16", ("--kv-dtype", "bf16")),
    Variant("no-ssd", ssd=False),
)


def variant_spec(base: ServerSpec, variant: Variant) -> ServerSpec:
    return replace(base, args=[*base.args, *variant.args], ssd=base.ssd and variant.ssd)


def run_variants(
    base: ServerSpec,
    run_against: Callable[[str, str], RunResult],
    log_dir: Path,
    variants: tuple[Variant, ...] = VARIANTS,
    startup_timeout_s: float = 600.0,
) -> dict[str, tuple[RunResult, list[str]]]:
    """Launch each variant in turn and run ``run_against(base_url, label)`` on it.

    Returns label -> (result, the server's command line)."""
    out = {}
    for v in variants:
        spec = variant_spec(base, v)
        with LaunchedServer(spec, log_dir / f"server-{v.label}.log", startup_timeout_s) as server:
            out[v.label] = (run_against(server.base_url, v.label), server.command)
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def ratios(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, float | None]:
    """``other[k] / base[k]`` for every numeric key of both; None where base is 0."""
    out: dict[str, float | None] = {}
    for key, b in base.items():
        o = other.get(key)
        if _is_number(b) and _is_number(o):
            out[key] = o / b if b != 0 else None
    return out


def compare_documents(documents: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Each non-default run's metrics and server counters as ratios to the default run."""
    base = documents[BASELINE]
    out: dict[str, Any] = {}
    for label, doc in documents.items():
        if label == BASELINE:
            continue
        entry: dict[str, Any] = {"metrics": ratios(base["metrics"], doc["metrics"])}
        if base.get("server_counters_delta") and doc.get("server_counters_delta"):
            entry["server_counters_delta"] = ratios(
                base["server_counters_delta"], doc["server_counters_delta"]
            )
        out[label] = entry
    return out


def _cell(x: float | None) -> str:
    return f"{'-':>13}" if x is None else f"{x:>13.3f}"


def format_compare(documents: Mapping[str, Mapping[str, Any]], table: Mapping[str, Any]) -> str:
    """Headline metrics of the default run and each ablation's ratio to it."""
    labels = list(table)
    base = documents[BASELINE]
    lines = [
        "Ablations: ratio to the default server (1.000 = same)",
        f"{'metric':<26}{BASELINE:>13}" + "".join(f"{label:>13}" for label in labels),
    ]
    for key in HEADLINE:
        if key in base["metrics"]:
            cells = "".join(_cell(table[label]["metrics"].get(key)) for label in labels)
            lines.append(f"{key:<26}{base['metrics'][key]:>13.3f}{cells}")
    counters = base.get("server_counters_delta") or {}
    for key in HEADLINE_COUNTERS:
        if key in counters:
            cells = "".join(
                _cell(table[label].get("server_counters_delta", {}).get(key)) for label in labels
            )
            lines.append(f"{key:<26}{counters[key]:>13.0f}{cells}")
    return "\n".join(lines)
