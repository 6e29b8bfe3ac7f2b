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

    .venv/bin/python bench/disagg.py --routing-ablation 2

compares the router's two ways of choosing workers instead (``--routing
least-loaded`` vs ``affinity``), split against split, with two decode workers
sharing the second core: how many bytes each reads back from the SSD tier, and
what that does to latency.
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
from bench.serving.workloads import workload_from_args  # noqa: E402
from engine.loader.tokenizer import load_tokenizer  # noqa: E402

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


def _handover(decode_urls: list[str], router_url: str) -> dict[str, Any]:
    """The split run's handover, summed over its decode workers."""
    d: dict[str, float] = {}
    for url in decode_urls:
        for name, value in _samples(httpx.get(url + "/metrics", timeout=10).text).items():
            d[name] = d.get(name, 0.0) + value
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


def run_split(
    args: argparse.Namespace,
    run,
    log_dir: Path,
    routing: str = "affinity",
    decode_workers: int = 1,
) -> dict[str, Any]:
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
            decodes = [
                stack.enter_context(
                    LaunchedServer(
                        _pinned(second, 1, args.model, ["--role", "decode", *shared], ssd=False),
                        log_dir / f"decode{i}.log",
                    )
                )
                for i in range(decode_workers)
            ]
            urls = ["--prefill-url", prefill.base_url, "--routing", routing]
            for decode in decodes:
                urls += ["--decode-url", decode.base_url]
            router = stack.enter_context(
                LaunchedServer(
                    _pinned(args.cores, 1, args.model, ["--role", "router", *urls], ssd=False),
                    log_dir / "router.log",
                )
            )
            metrics = run(router.base_url)
            handover = _handover([d.base_url for d in decodes], router.base_url)
            return {"metrics": metrics, "handover": handover}
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
    p.add_argument(
        "--routing-ablation",
        type=int,
        metavar="DECODE_WORKERS",
        help="compare split with --routing least-loaded vs affinity, this many decode workers",
    )
    p.set_defaults(workload="agent")
    args = p.parse_args(argv)
    if len(args.cores.split(",")) != 2:
        p.error("--cores takes two cores, e.g. 0,1")

    tokenizer = load_tokenizer()
    workload = workload_from_args(args, tokenizer)  # the agent workload of `flashserve bench`
    arrivals = Arrivals(args.request_rate, seed=args.seed)

    def run(base_url: str) -> dict[str, Any]:
        cfg = ClientConfig(base_url=base_url, model="")
        result = asyncio.run(run_workload(workload, cfg, tokenizer, arrivals, "disagg", False))
        return compute_metrics(result.records, result.duration_s)

    n = args.routing_ablation
    variants = {
        "colocated": lambda log_dir: run_colocated(args, run, log_dir),
        "split": lambda log_dir: run_split(args, run, log_dir),
    }
    if n:
        variants = {
            "least-loaded": lambda log_dir: run_split(args, run, log_dir, "least-loaded", n),
            "affinity": lambda log_dir: run_split(args, run, log_dir, "affinity", n),
        }
    base, other = variants
    runs: list[dict[str, Any]] = []
    for k in range(args.rounds):
        order = (base, other) if k % 2 == 0 else (other, base)
        round_runs = {}
        for topology in order:
            log_dir = args.output_dir / f"round{k}" / topology
            log_dir.mkdir(parents=True, exist_ok=True)
            round_runs[topology] = variants[topology](log_dir)
            m = round_runs[topology]["metrics"]
            print(
                f"round {k} {topology:9s}: {m['completed']} ok / {m['failed']} failed, "
                f"{m['request_throughput']:.3f} req/s, mean TTFT {m['mean_ttft_ms']:.0f} ms, "
                f"mean TPOT {m['mean_tpot_ms']:.0f} ms",
                flush=True,
            )
        runs.append(round_runs)

    summary = _summary(runs, base, other)
    print(_table(summary, base, other))
    for k, r in enumerate(runs):
        for name in (base, other):
            if "handover" in r[name]:
                print(f"round {k} {name} handover: {json.dumps(r[name]['handover'])}")
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


def _summary(
    runs: list[dict[str, Any]], base: str = "colocated", other: str = "split"
) -> dict[str, Any]:
    """Per metric: each variant's median over rounds and ``other / base`` per round."""
    out: dict[str, Any] = {}
    for key, _ in HEADLINE:
        co = [r[base]["metrics"][key] for r in runs]
        sp = [r[other]["metrics"][key] for r in runs]
        out[key] = {
            "base_median": statistics.median(co),
            "other_median": statistics.median(sp),
            "ratio_per_round": [s / c if c else None for s, c in zip(sp, co, strict=True)],
            "ratio_median": statistics.median(s / c for s, c in zip(sp, co, strict=True) if c),
        }
    return out


def _table(summary: dict[str, Any], base: str = "colocated", other: str = "split") -> str:
    lines = [
        f"| metric | {base} (median) | {other} (median) | {other} / {base}, per round | median |",
        "|---|---|---|---|---|",
    ]
    for key, label in HEADLINE:
        s = summary[key]
        per_round = " / ".join(f"{r:.2f}" for r in s["ratio_per_round"] if r is not None)
        co, sp = _fmt(s["base_median"]), _fmt(s["other_median"])
        lines.append(f"| {label} | {co} | {sp} | {per_round} | {s['ratio_median']:.2f} |")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


if __name__ == "__main__":
    raise SystemExit(main())
