"""A run's JSON document, its terminal table (vLLM's layout), and PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.serving.client import RequestRecord
from bench.serving.driver import RunResult
from bench.serving.metrics import (
    PERCENTILES,
    cache_hit_by_turn,
    compute_metrics,
    counter_deltas,
    tpot,
)

# The server counters the table shows (all of them are in the JSON).
HEADLINE_COUNTERS = ("replay_tokens", "preemptions", "prompt_cache_hit_tokens")
_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def run_document(
    result: RunResult,
    *,
    label: str,
    slos_ms: dict[str, float] | None = None,
    context: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything about one run: context, metrics, server counter deltas, raw records."""
    counters = None
    if result.counters_before is not None and result.counters_after is not None:
        counters = counter_deltas(result.counters_before, result.counters_after)
    return {
        "label": label,
        **(context or {}),
        "model": result.model,
        "metrics": compute_metrics(result.records, result.duration_s, slos_ms),
        "server_counters_delta": counters,
        "records": [r.to_dict() for r in result.records],
    }


def records_of(document: Mapping[str, Any]) -> list[RequestRecord]:
    """The raw records of a run document, back as ``RequestRecord``s."""
    return [RequestRecord(**r) for r in document["records"]]


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=1) + "\n")


def _finite(x: Any) -> Any:
    """JSON has no Infinity: write non-finite floats as strings ("inf")."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _row(name: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{name:<40}{value:<10.2f}"
    return f"{name:<40}{value!s:<10}"


def format_table(document: Mapping[str, Any]) -> str:
    """The run's numbers as ``vllm bench serve`` prints them, plus cache and counters."""
    m = document["metrics"]
    lines = [
        "{s:{c}^{n}}".format(s=f" Serving Benchmark Result: {document['label']} ", n=50, c="="),
        _row("Successful requests:", m["completed"]),
        _row("Failed requests:", m["failed"]),
        _row("Benchmark duration (s):", m["duration"]),
        _row("Total input tokens:", m["total_input_tokens"]),
        _row("Total generated tokens:", m["total_output_tokens"]),
        _row("Request throughput (req/s):", m["request_throughput"]),
    ]
    if "request_goodput" in m:
        lines.append(_row("Request goodput (req/s):", m["request_goodput"]))
    lines += [
        _row("Output token throughput (tok/s):", m["output_throughput"]),
        _row("Total token throughput (tok/s):", m["total_token_throughput"]),
    ]
    for key, short, title in _SECTIONS:
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", m[f"mean_{key}_ms"]))
        lines.append(_row(f"Median {short} (ms):", m[f"median_{key}_ms"]))
        for p in PERCENTILES:
            lines.append(_row(f"P{p:g} {short} (ms):", m[f"p{p:g}_{key}_ms"]))
    lines.append("{s:{c}^{n}}".format(s="Prompt cache", n=50, c="-"))
    lines.append(_row("Mean cache-hit share:", m["mean_cache_hit_share"]))
    lines.append(_row("Cache-hit tokens / prompt tokens:", m["cache_hit_token_share"]))
    by_turn = m["cache_hit_share_by_turn"]
    if len(by_turn) > 1:
        lines.append(
            "Cache-hit share by turn: " + ", ".join(f"{t}: {s:.2f}" for t, s in by_turn.items())
        )
    counters = document.get("server_counters_delta")
    lines.append("{s:{c}^{n}}".format(s="Server counters (during the run)", n=50, c="-"))
    if counters is None:
        lines.append("(no /metrics on this server)")
    else:
        for name in HEADLINE_COUNTERS:
            if name in counters:
                lines.append(_row(f"{name}:", int(counters[name])))
    lines.append("=" * 50)
    return "\n".join(lines)


def _cdf_axes(ax: Any, values_ms: Sequence[float], label: str) -> None:
    v = np.sort(np.asarray(values_ms, dtype=np.float64))
    if v.size:
        # Start at (first value, 0) so the first step is drawn.
        ax.step(np.r_[v[0], v], np.arange(v.size + 1) / v.size, where="post", label=label)


def write_plots(runs: Mapping[str, Sequence[RequestRecord]], out_dir: Path) -> list[Path]:
    """TTFT and TPOT CDFs and the cache-hit share per turn, one line per run label."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, title, values in (
        ("ttft_cdf.png", "TTFT CDF", lambda rs: [r.ttft * 1e3 for r in rs]),
        (
            "tpot_cdf.png",
            "TPOT CDF",
            lambda rs: [t * 1e3 for r in rs if (t := tpot(r)) is not None],
        ),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, records in runs.items():
            _cdf_axes(ax, values([r for r in records if r.success]), label)
        ax.set_xlabel(f"{title.split()[0]} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, records in runs.items():
        by_turn = cache_hit_by_turn(records)
        ax.plot(list(by_turn), list(by_turn.values()), marker="o", label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("turn")
    ax.set_ylabel("prompt_cache_hit_tokens / prompt_tokens (mean)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Cache-hit share per turn")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "cache_hit_per_turn.png", dpi=110)
    plt.close(fig)
    paths.append(out_dir / "cache_hit_per_turn.png")
    return paths
