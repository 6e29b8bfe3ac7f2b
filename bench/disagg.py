"""Colocated vs split (disaggregated) serving at equal total cores, on the agent workload.

    .venv/bin/python bench/disagg.py --rounds 3

- colocated: one ``flashserve serve`` on cores {0, 1} with two intra-op threads;
- split: a prefill worker on core 0 and a decode worker on core 1 (one thread
  each) sharing a fresh SSD-tier directory, and a router (no model) that may
  run on either core.

Each round runs both topologies on the same workload, in alternating order,
with fresh servers and directories every run, so each pair of numbers is
measured side by side. Reported: TTFT, TPOT and throughput per run, the split
over colocated ratio per round and its median, and the split runs' handover
(bytes read per handed-over token, publish-to-admit latency, fallbacks) from
the decode worker's and router's /metrics. Results: ``--output-dir``/disagg.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shutil
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.serving.client import ClientConfig  # noqa: E402
from bench.serving.driver import Arrivals, run_workload  # noqa: E402
from bench.serving.launch import LaunchedServer, ServerSpec  # noqa: E402
from bench.serving.metrics import compute_metrics  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from flashserve.bench_cmd import build_workload  # noqa: E402

HEADLINE = (
    ("mean_ttft_ms", "mean TTFT (ms)"),
    ("median_ttft_ms", "median TTFT (ms)"),
    ("p99_ttft_ms", "p99 TTFT (ms)"),
    ("mean_tpot_ms", "mean TPOT (ms)"),
    ("median_tpot_ms", "median TPOT (ms)"),
    ("request_throughput", "requests/s"),
    ("output_throughput", "output tok/s"),
    ("total_token_throughput", "total tok/s"),
)


def _pinned(cores: str, threads: int, model: str, args: list[str], ssd: bool) -> ServerSpec:
    return ServerSpec(
        model,
        args,
        ssd=ssd,
        wrapper=["taskset", "-c", cores],
        env={"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)},
    )


def _samples(text: str) -> dict[str, float]:
    """``name{labels}`` -> value of every flashserve sample (labels but model_name kept)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def _handover(decode_url: str, router_url: str) -> dict[str, Any]:
    d = _samples(httpx.get(decode_url + "/metrics", timeout=10).text)
    r = _samples(httpx.get(router_url + "/metrics", timeout=10).text)
    count = d["flashserve:disagg_handover_seconds_count{}"]
    ssd_tokens = d["flashserve:prefix_cache_hits_total{tier=ssd}"]
    handed_bytes = d["flashserve:disagg_handover_bytes_sum{}"]
    prefill_calls = r["flashserve:disagg_prefill_seconds_count{}"]
    return {
        "handovers": count,
        "handover_latency_mean_ms": 1e3 * d["flashserve:disagg_handover_seconds_sum{}"] / count
        if count
        else None,
        "handover_bytes_total": handed_bytes,
        "handover_ssd_tokens": ssd_tokens,
        "handover_bytes_per_token": handed_bytes / ssd_tokens if ssd_tokens else None,
        "prefill_call_mean_ms": 1e3 * r["flashserve:disagg_prefill_seconds_sum{}"] / prefill_calls
        if prefill_calls
        else None,
        "fallbacks": {
            reason: r[f"flashserve:disagg_fallbacks_total{{reason={reason}}}"]
            + d[f"flashserve:disagg_fallbacks_total{{reason={reason}}}"]
            for reason in ("prefill_timeout", "prefill_error", "missing_pages")
        },
    }


def run_colocated(args: argparse.Namespace, run, log_dir: Path) -> dict[str, Any]:
    spec = _pinned(args.cores, 2, args.model, args.server_args, ssd=True)
    with LaunchedServer(spec, log_dir / "colocated.log") as server:
        return {"metrics": run(server.base_url)}


def run_split(args: argparse.Namespace, run, log_dir: Path) -> dict[str, Any]:
    first, second = args.cores.split(",")
    kv_dir = Path(tempfile.mkdtemp(prefix="flashserve-disagg-kv-"))
    shared = ["--kv-dir", str(kv_dir), *args.server_args]
    try:
        with ExitStack() as stack:
            prefill = stack.enter_context(
                LaunchedServer(
                    _pinned(first, 1, args.model, ["--role", "prefill", *shared], ssd=False),
                    log_dir / "prefill.log",
                )
            )
            decode = stack.enter_context(
                LaunchedServer(
                    _pinned(second, 1, args.model, ["--role", "decode", *shared], ssd=False),
                    log_dir / "decode.log",
                )
            )
            urls = ["--prefill-url", prefill.base_url, "--decode-url", decode.base_url]
            router = stack.enter_context(
                LaunchedServer(
                    _pinned(args.cores, 1, args.model, ["--role", "router", *urls], ssd=False),
                    log_dir / "router.log",
                )
            )
            metrics = run(router.base_url)
            return {"metrics": metrics, "handover": _handover(decode.base_url, router.base_url)}
    finally:
        shutil.rmtree(kv_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--cores", default="0,1", help="two cores: colocated uses both, split one each")
    p.add_argument("--num-agents", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--task-len", type=int, default=64)
    p.add_argument("--tool-result-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", nargs="*", default=[], help="more `serve` flags for all")
    p.add_argument("--output-dir", type=Path, default=REPO / "bench/results/disagg")
    p.set_defaults(workload="agent")
    args = p.parse_args(argv)
    if len(args.cores.split(",")) != 2:
        p.error("--cores takes two cores, e.g. 0,1")

    tokenizer = load_tokenizer()
    workload = build_workload(args, tokenizer)  # the agent workload of `flashserve bench`
    arrivals = Arrivals(args.request_rate, seed=args.seed)

    def run(base_url: str) -> dict[str, Any]:
        cfg = ClientConfig(base_url=base_url, model="")
        result = asyncio.run(run_workload(workload, cfg, tokenizer, arrivals, "disagg", False))
        return compute_metrics(result.records, result.duration_s)

    runs: list[dict[str, Any]] = []
    for k in range(args.rounds):
        order = ("colocated", "split") if k % 2 == 0 else ("split", "colocated")
        round_runs = {}
        for topology in order:
            log_dir = args.output_dir / f"round{k}"
            log_dir.mkdir(parents=True, exist_ok=True)
            start = run_colocated if topology == "colocated" else run_split
            round_runs[topology] = start(args, run, log_dir)
            m = round_runs[topology]["metrics"]
            print(
                f"round {k} {topology:9s}: {m['completed']} ok / {m['failed']} failed, "
                f"{m['request_throughput']:.3f} req/s, mean TTFT {m['mean_ttft_ms']:.0f} ms, "
                f"mean TPOT {m['mean_tpot_ms']:.0f} ms",
                flush=True,
            )
        runs.append(round_runs)

    summary = _summary(runs)
    print(_table(summary))
    for k, r in enumerate(runs):
        print(f"round {k} handover: {json.dumps(r['split']['handover'])}")
    document = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["bench/disagg.py", *(argv if argv is not None else sys.argv[1:])]),
        "workload": workload.params | {"num_requests": workload.num_requests},
        "summary": summary,
        "runs": runs,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "disagg.json").write_text(json.dumps(document, indent=1))
    failed = sum(r[t]["metrics"]["failed"] for r in runs for t in r)
    return 1 if failed else 0


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, _ in HEADLINE:
        co = [r["colocated"]["metrics"][key] for r in runs]
        sp = [r["split"]["metrics"][key] for r in runs]
        out[key] = {
            "colocated_median": statistics.median(co),
            "split_median": statistics.median(sp),
            "ratio_per_round": [s / c if c else None for s, c in zip(sp, co, strict=True)],
            "ratio_median": statistics.median(s / c for s, c in zip(sp, co, strict=True) if c),
        }
    return out


def _table(summary: dict[str, Any]) -> str:
    lines = [
        "| metric | colocated (median) | split (median) | split / colocated, per round | median |",
        "|---|---|---|---|---|",
    ]
    for key, label in HEADLINE:
        s = summary[key]
        per_round = " / ".join(f"{r:.2f}" for r in s["ratio_per_round"] if r is not None)
        co, sp = _fmt(s["colocated_median"]), _fmt(s["split_median"])
        lines.append(f"| {label} | {co} | {sp} | {per_round} | {s['ratio_median']:.2f} |")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


if __name__ == "__main__":
    raise SystemExit(main())
