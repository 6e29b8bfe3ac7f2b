"""``flashserve bench``: drive a server over HTTP with an agent, shared-prefix or random
workload and report vLLM's serving metrics (bench/serving/, docs/BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path
from typing import Any

NAME = "bench"
HELP = "benchmark a server over HTTP: TTFT, TPOT, throughput, cache hits, ablations"

REPO = Path(__file__).resolve().parents[1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server")
    server.add_argument(
        "--launch", action="store_true", help="start `flashserve serve` on a free loopback port"
    )
    server.add_argument("--launch-model", default="tiny", help="--model of the launched server")
    server.add_argument(
        "--server-args", default="", help="more `flashserve serve` flags, one quoted string"
    )
    server.add_argument(
        "--no-kv-dir", action="store_true", help="launch without an SSD tier (no --kv-dir)"
    )
    server.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    server.add_argument("--model", default="", help="API model name (default: /v1/models' first)")
    server.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    server.add_argument("--api-key", default=None)
    server.add_argument("--tokenizer", default=None, help="tokenizer.json or checkpoint dir")

    work = parser.add_argument_group("workload")
    work.add_argument("--workload", choices=("agent", "shared-prefix", "random"), default="agent")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--output-len", type=int, default=32, help="max_tokens of every request")
    work.add_argument("--num-agents", type=int, default=4, help="agent: concurrent sessions")
    work.add_argument("--turns", type=int, default=4, help="agent: requests per session")
    work.add_argument(
        "--system-len", type=int, default=512, help="agent, shared-prefix: system prompt tokens"
    )
    work.add_argument("--task-len", type=int, default=64, help="agent: first user message")
    work.add_argument("--tool-result-len", type=int, default=256, help="agent: per later turn")
    work.add_argument("--num-groups", type=int, default=4, help="shared-prefix: prefixes")
    work.add_argument("--prompts-per-group", type=int, default=4, help="shared-prefix")
    work.add_argument("--question-len", type=int, default=64, help="shared-prefix")
    work.add_argument("--num-prompts", type=int, default=16, help="random")
    work.add_argument("--input-len", type=int, default=256, help="random")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max_tokens (vLLM extension)"
    )
    work.add_argument(
        "--thinking",
        choices=("disabled", "enabled", "server"),
        default="disabled",
        help="chat: thinking.type to send (server = send none)",
    )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=float("inf"), help="sessions/s (inf = all at once)"
    )
    load.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape; 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")

    out = parser.add_argument_group("output")
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs: ttft:MS tpot:MS e2el:MS",
    )
    out.add_argument(
        "--compare",
        action="store_true",
        help="also launch --disable-ced, --kv-dtype bf16 and no --kv-dir servers; report ratios",
    )
    out.add_argument("--output-dir", type=Path, default=REPO / "bench" / "results" / "serving")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--quiet", action="store_true", help="no progress line")


def _import_path() -> None:
    """``bench`` is not an installed package: it is found in the source checkout."""
    if (REPO / "bench" / "serving").is_dir() and str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


def _tokenizer(args: argparse.Namespace) -> Any:
    from engine.loader.tokenizer import TOKENIZER_FILE, load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    model_dir = Path(args.launch_model)
    if (args.launch or args.compare) and (model_dir / TOKENIZER_FILE).is_file():
        return load_tokenizer(model_dir)  # a checkpoint's own tokenizer wins
    return load_tokenizer()


def _command_line(args: argparse.Namespace) -> str:
    """The command as typed when run from the shell, else rebuilt from the options;
    an API key is never written down."""
    if sys.argv[1:2] == [NAME]:
        words = list(sys.argv[1:])
        for i, word in enumerate(words):
            if word.startswith("--api-key="):
                words[i] = "--api-key=***"
            elif word == "--api-key" and i + 1 < len(words):
                words[i + 1] = "***"
        return shlex.join(["flashserve", *words])
    hidden = ("run", "command", "verbose", "api_key")
    options = {k: v for k, v in vars(args).items() if k not in hidden}
    return f"flashserve {NAME} " + " ".join(f"{k}={v}" for k, v in sorted(options.items()))


def run(args: argparse.Namespace) -> int:
    _import_path()
    import httpx

    try:
        return _run(args)
    except (ValueError, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        # Bad sizes, or a server that would not start or answer: one line, no traceback.
        print(f"flashserve bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    import asyncio

    from bench.serving import compare, report
    from bench.serving.client import ClientConfig
    from bench.serving.driver import Arrivals, RunResult, run_workload
    from bench.serving.launch import LaunchedServer, ServerSpec
    from bench.serving.metrics import parse_goodput
    from bench.serving.workloads import workload_from_args

    if args.compare and args.no_kv_dir:
        print("--compare launches its own no-SSD server; drop --no-kv-dir", file=sys.stderr)
        return 2
    slos = parse_goodput(args.goodput) if args.goodput else None
    tokenizer = _tokenizer(args)
    workload = workload_from_args(args, tokenizer)
    arrivals = Arrivals(args.request_rate, args.burstiness, args.max_concurrency, args.seed)
    context: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": _command_line(args),
        "endpoint": args.endpoint,
        "workload": {
            "name": workload.name,
            "num_requests": workload.num_requests,
            **workload.params,
        },
        "arrivals": {
            "request_rate": arrivals.request_rate,
            "burstiness": arrivals.burstiness,
            "max_concurrency": arrivals.max_concurrency,
        },
        "goodput_slos_ms": slos,
    }

    def run_against(base_url: str, label: str) -> RunResult:
        cfg = ClientConfig(
            base_url=base_url,
            model=args.model,
            endpoint=args.endpoint,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            thinking=None if args.thinking == "server" else args.thinking,
            api_key=args.api_key,
        )
        return asyncio.run(run_workload(workload, cfg, tokenizer, arrivals, label, not args.quiet))

    spec = ServerSpec(args.launch_model, shlex.split(args.server_args), ssd=not args.no_kv_dir)
    out_dir: Path = args.output_dir
    if args.compare:
        runs = compare.run_variants(
            spec, run_against, out_dir, startup_timeout_s=args.startup_timeout
        )
        documents = {
            label: report.run_document(
                result,
                label=label,
                slos_ms=slos,
                context={**context, "server_command": command},
            )
            for label, (result, command) in runs.items()
        }
        table = compare.compare_documents(documents)
        for doc in documents.values():
            print(report.format_table(doc))
        print(compare.format_compare(documents, table))
        report.write_json(
            out_dir / "serving_compare.json", {**context, "ratios": table, "runs": documents}
        )
    else:
        if args.launch:
            log = out_dir / "server.log"
            with LaunchedServer(spec, log, args.startup_timeout) as server:
                result = run_against(server.base_url, "default")
                context |= {"base_url": server.base_url, "server_command": server.command}
        else:
            result = run_against(args.base_url.rstrip("/"), "default")
            context["base_url"] = args.base_url
        documents = {
            "default": report.run_document(result, label="default", slos_ms=slos, context=context)
        }
        print(report.format_table(documents["default"]))
        report.write_json(out_dir / "serving.json", documents["default"])
    if not args.no_plots:
        plots = report.write_plots(
            {label: report.records_of(doc) for label, doc in documents.items()}, out_dir
        )
        print("plots: " + ", ".join(str(p) for p in plots))
    print(f"results: {out_dir}")
    failed = sum(doc["metrics"]["failed"] for doc in documents.values())
    return 1 if failed else 0
