"""``flashserve serve``: load a checkpoint, start the engine, serve the API with uvicorn.

``--model tiny`` is the built-in tiny checkpoint: written once with
``make_tiny`` into the cache directory and then loaded like any checkpoint, so
serving it runs the real loader and the real tokenizer file. The cache
directory is ``$FLASHSERVE_CACHE``, else ``$XDG_CACHE_HOME/flashserve``, else
``~/.cache/flashserve``; the checkpoint is ``tiny-seed{SEED}`` inside it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

    from engine.config import EngineConfig
    from server.openai.pricing import PriceTable
    from server.settings import ServerSettings

NAME = "serve"
HELP = "serve the OpenAI/DeepSeek-compatible API (--model tiny or a checkpoint directory)"

CACHE_ENV = "FLASHSERVE_CACHE"
# Set to 1 (true, yes): the engine core runs in the API process (--in-process-engine).
IN_PROCESS_ENV = "FLASHSERVE_IN_PROCESS_ENGINE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--role",
        choices=("both", "prefill", "decode", "router"),
        default="both",
        help="both: one colocated server (default); prefill / decode: a worker of a split "
        "deployment, sharing --kv-dir with the other pool; router: the split deployment's "
        "front end (no model; see --prefill-url, --decode-url)",
    )
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (built-in random checkpoint), 'demo' (the trained models/demo) or a "
        "checkpoint dir",
    )
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="listen port; 0 = any free port")
    http.add_argument(
        "--served-model-name", default="deepseek-flash", help="API model name (default %(default)s)"
    )
    http.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="accepted API key (repeatable; also FLASHSERVE_API_KEYS, comma-separated); "
        "none = no authentication",
    )
    http.add_argument("--max-body-bytes", type=int, default=32 << 20, help="larger bodies get 413")
    http.add_argument(
        "--keep-alive-seconds",
        type=float,
        default=10.0,
        help="SSE ': keep-alive' comment after this long without an event",
    )
    http.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="requests held at once (running or queued); more get 429 (default: no limit)",
    )
    http.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="output budget of requests naming none, both modes (default: DeepSeek's, "
        "4096 non-thinking and 32768 thinking, capped by the context)",
    )
    http.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    http.add_argument(
        "--vllm-metric-aliases",
        action="store_true",
        help="also expose scheduler and cache metrics under vLLM's names (vllm:...), for "
        "the Gateway API inference extension and llm-d (docs/metrics.md)",
    )

    cost = parser.add_argument_group(
        "cost (server/openai/pricing.py): usage.cost and cost counters"
    )
    cost.add_argument(
        "--prices",
        default=None,
        metavar="HIT,MISS,OUTPUT",
        help="prices per million tokens: cache-hit input, cache-miss input, output",
    )
    cost.add_argument(
        "--off-peak-window",
        default=None,
        metavar="HH:MM-HH:MM",
        help="UTC window priced at --off-peak-discount (may wrap midnight, e.g. 16:30-00:30)",
    )
    cost.add_argument(
        "--off-peak-discount",
        type=float,
        default=0.0,
        help="fraction off every price in the off-peak window (0.5 = half price)",
    )
    cost.add_argument("--currency", default="USD", help="currency of --prices (default USD)")
    cost.add_argument(
        "--price-file",
        default=None,
        help="JSON price table instead of the flags above (docs/metrics.md, 'Cost')",
    )

    limits = parser.add_argument_group("limits and timeouts (docs/design/hardening.md)")
    limits.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=256,
        help="engine sequences one request may create, prompts x n (default %(default)s)",
    )
    limits.add_argument(
        "--max-concurrent-sequences",
        type=int,
        default=4096,
        help="engine sequences held by all requests at once; more get 429; 0 = no limit "
        "(default %(default)s)",
    )
    limits.add_argument(
        "--preprocess-workers",
        type=int,
        default=4,
        help="threads that tokenise and plan requests off the event loop (default %(default)s)",
    )
    limits.add_argument(
        "--preprocess-timeout",
        type=float,
        default=30.0,
        help="seconds a request may spend tokenising and building its grammar (default "
        "%(default)s)",
    )
    limits.add_argument(
        "--grammar-timeout",
        type=float,
        default=10.0,
        help="seconds one grammar compilation may take; longer: 400 (default %(default)s)",
    )
    limits.add_argument(
        "--max-grammar-schema-bytes",
        type=int,
        default=256 << 10,
        help="JSON bytes of the schemas one request may enforce (default %(default)s)",
    )
    limits.add_argument(
        "--grammar-cache-bytes",
        type=int,
        default=256 << 20,
        help="compiled grammars kept, LRU, in bytes (default %(default)s)",
    )
    limits.add_argument(
        "--grammar-workers",
        type=int,
        default=2,
        help="grammar compilations at once (default %(default)s)",
    )
    limits.add_argument(
        "--health-stall-timeout",
        type=float,
        default=30.0,
        help="/health is 503 when requests are pending and no engine step finished for this "
        "many seconds (default %(default)s)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's headers; then 408 (default "
        "%(default)s)",
    )
    limits.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request's body may take to arrive; then 408 (default %(default)s)",
    )
    limits.add_argument(
        "--shutdown-timeout",
        type=float,
        default=20.0,
        help="on SIGTERM/SIGINT: seconds to drain open requests, then as long again at most to "
        "stop the engine and flush the SSD tier (default %(default)s)",
    )

    split = parser.add_argument_group("split deployment (docs/design/disaggregation.md)")
    split.add_argument(
        "--prefill-url", action="append", default=[], help="router: a prefill worker (repeatable)"
    )
    split.add_argument(
        "--decode-url", action="append", default=[], help="router: a decode worker (repeatable)"
    )
    split.add_argument(
        "--prefill-timeout",
        type=float,
        default=120.0,
        help="router: seconds a prefill call may take before the decode worker prefills "
        "instead (default %(default)s)",
    )
    split.add_argument(
        "--decode-timeout",
        type=float,
        default=600.0,
        help="router: seconds between two reads of a decode worker's answer (default %(default)s)",
    )
    split.add_argument(
        "--routing",
        choices=("affinity", "least-loaded"),
        default="affinity",
        help="router: affinity keeps a conversation on one worker of each pool (its device "
        "tier holds the earlier turns) unless that worker is --affinity-slack requests busier "
        "than the least busy; least-loaded ignores conversations (default %(default)s)",
    )
    split.add_argument(
        "--affinity-slack", type=int, default=4, help="router: see --routing (default 4)"
    )
    split.add_argument(
        "--publish-timeout",
        type=float,
        default=60.0,
        help="prefill worker: seconds to wait for pages to reach the SSD tier; later ones are "
        "left to the decode worker (default %(default)s)",
    )

    engine = parser.add_argument_group("engine (EngineConfig)")
    engine.add_argument(
        "--in-process-engine",
        action="store_true",
        default=None,
        help="run the engine core (scheduler and model loop) in a thread of the API process "
        f"instead of a process of its own (also {IN_PROCESS_ENV}=1; docs/design/engine.md, "
        "'Process layout')",
    )
    engine.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    engine.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="rows per engine step"
    )
    engine.add_argument(
        "--prefill-chunk-tokens", type=int, default=512, help="prefill rows per sequence per step"
    )
    engine.add_argument("--page-tokens", type=int, default=64, help="tokens per KV page")
    engine.add_argument(
        "--kv-cache-bytes", type=int, default=1 << 30, help="device KV tier budget in bytes"
    )
    engine.add_argument("--kv-dir", default=None, help="SSD KV tier directory (default: none)")
    engine.add_argument(
        "--kv-dir-bytes", type=int, default=None, help="SSD tier budget (default: unbounded)"
    )
    engine.add_argument(
        "--replay-tokens", type=int, default=None, help="bounded-replay window (default: SWA)"
    )
    engine.add_argument(
        "--disable-ced", action="store_true", help="full-depth prefill instead of CED"
    )
    engine.add_argument("--kv-dtype", choices=("fp4", "bf16"), default="fp4")
    engine.add_argument("--device", default="cpu", help="torch device (default cpu)")
    engine.add_argument(
        "--device-memory-gib",
        type=float,
        default=None,
        help="memory of the device in GiB for the start-up memory plan (default: the CUDA "
        "device's total memory; for cpu the host's, less the Engram tables it also holds); "
        "serve refuses to start when the weights and the reserve do not fit",
    )
    engine.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16", "float64"),
        default="float32",
        help="dtype of unquantised weights and of activations (float64: exact comparisons "
        "in tests)",
    )
    engine.add_argument(
        "--quantization",
        choices=("auto", "none"),
        default="auto",
        help="auto: keep the checkpoint's FP8/FP4 weights packed, activations quantised per "
        "block of 32 (the release's numerics); none: dequantise at load to --dtype",
    )
    engine.add_argument(
        "--max-model-len", type=int, default=None, help="prompt + output cap (default: model's)"
    )
    engine.add_argument("--runner", choices=("paged", "reference"), default="paged")
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every decode step eagerly instead of replaying CUDA graphs captured "
        "at start-up for the bucketed batch sizes (docs/design/cuda-graphs.md); on cpu graphs "
        "are never used",
    )
    engine.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="CUDA: decode batch sizes to capture (default 1 2 4 8 16 24 ... up to "
        "--max-num-seqs); a larger batch runs eagerly; ignored on cpu",
    )
    engine.add_argument(
        "--seed", type=int, default=0, help="tiny model weights and the sampling RNG (default 0)"
    )
    from flashserve.parallel_args import add_parallel_arguments

    add_parallel_arguments(parser)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the flags describe."""
    from engine.config import EngineConfig
    from flashserve.parallel_args import parallel_fields

    return EngineConfig(
        **parallel_fields(args),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk_tokens=args.prefill_chunk_tokens,
        page_tokens=args.page_tokens,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_dir=args.kv_dir,
        kv_dir_bytes=args.kv_dir_bytes,
        replay_tokens=args.replay_tokens,
        enable_ced=not args.disable_ced,
        kv_dtype=args.kv_dtype,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        max_model_len=args.max_model_len,
        runner=args.runner,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=tuple(args.cuda_graph_sizes) if args.cuda_graph_sizes else None,
    )


def in_process_engine(args: argparse.Namespace, env: dict[str, str] | None = None) -> bool:
    """Whether the engine core runs in the API process: the flag, else the environment."""
    if args.in_process_engine:
        return True
    value = (os.environ if env is None else env).get(IN_PROCESS_ENV, "")
    return value.strip().lower() in ("1", "true", "yes")


def server_settings(
    args: argparse.Namespace, fingerprint: str, env: dict[str, str] | None = None
) -> ServerSettings:
    """The ``ServerSettings`` the flags (and ``FLASHSERVE_API_KEYS``) describe."""
    from server.settings import ServerSettings, collect_api_keys

    return ServerSettings(
        served_model_name=args.served_model_name,
        api_keys=collect_api_keys(args.api_key, os.environ if env is None else env),
        max_body_bytes=args.max_body_bytes,
        keep_alive_s=args.keep_alive_seconds,
        max_concurrent_requests=args.max_concurrent_requests,
        default_max_tokens=args.default_max_tokens,
        system_fingerprint=fingerprint,
        role=args.role if args.role != "router" else "both",
        publish_timeout_s=args.publish_timeout,
        max_sequences_per_request=args.max_sequences_per_request,
        max_concurrent_sequences=args.max_concurrent_sequences or None,
        preprocess_workers=args.preprocess_workers,
        preprocess_timeout_s=args.preprocess_timeout,
        grammar_timeout_s=args.grammar_timeout,
        max_grammar_schema_bytes=args.max_grammar_schema_bytes,
        grammar_cache_bytes=args.grammar_cache_bytes,
        grammar_workers=args.grammar_workers,
        health_stall_s=args.health_stall_timeout,
        body_read_timeout_s=args.body_timeout,
        prices=price_table(args),
        vllm_metric_aliases=args.vllm_metric_aliases,
    )


def uvicorn_config(app: object, args: argparse.Namespace) -> uvicorn.Config:
    """uvicorn's settings: the address, and the bounds on slow clients and on shutdown."""
    import uvicorn

    from server.http.timeouts import header_timeout_protocol

    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=header_timeout_protocol(args.header_timeout),
        # Drain: open requests get this long after the stop signal, then are cancelled.
        timeout_graceful_shutdown=args.shutdown_timeout,  # type: ignore[arg-type]
    )


def price_table(args: argparse.Namespace) -> PriceTable | None:
    """The price table ``--price-file`` or ``--prices`` gives; None without either."""
    from server.openai.pricing import PriceTable

    if args.price_file and args.prices:
        raise SystemExit("flashserve serve: give --prices or --price-file, not both")
    try:
        if args.price_file:
            return PriceTable.from_file(args.price_file)
        if args.prices:
            return PriceTable.from_flags(
                args.prices,
                off_peak_window=args.off_peak_window,
                off_peak_discount=args.off_peak_discount,
                currency=args.currency,
            )
    except (OSError, ValueError) as exc:
        raise SystemExit(f"flashserve serve: {exc}") from None
    return None


def cache_dir(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "flashserve"
    return Path.home() / ".cache" / "flashserve"


def tiny_checkpoint(seed: int, root: Path) -> Path:
    """The tiny checkpoint of ``seed`` under ``root``, written on first use.

    It is written into a temporary sibling and renamed into place, so a
    directory that exists is complete (an interrupted first run leaves only
    the temporary, which the next run replaces).
    """
    from engine.loader.checkpoint_writer import make_tiny

    path = root / f"tiny-seed{seed}"
    if (path / "config.json").is_file():
        return path
    _say(f"writing the tiny checkpoint to {path} (first run)")
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tiny-seed{seed}.{os.getpid()}.tmp"
    with _Heartbeat("writing the tiny checkpoint", time.monotonic()):
        make_tiny(tmp, seed)
    try:
        tmp.rename(path)
    except OSError:  # another process got there first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def model_path(model: str, seed: int) -> Path:
    """The checkpoint directory ``--model`` names: ``tiny``, ``demo`` or a path."""
    if model == "tiny":
        return tiny_checkpoint(seed, cache_dir())
    if model == "demo":
        from training.demo_config import demo_checkpoint_dir

        return demo_checkpoint_dir()
    return Path(model)


def run(args: argparse.Namespace) -> int:
    problem = _role_problem(args)
    if problem:
        print(f"flashserve serve: {problem}", file=sys.stderr)
        return 2
    if args.role == "router":
        return _run_router(args)
    import asyncio

    import uvicorn

    from engine.api.async_engine import AsyncEngine
    from engine.api.core_client import EngineCoreClient
    from engine.api.protocol import EngineClient
    from engine.loader.builder import checkpoint_fingerprint
    from server.app import create_app

    started = time.monotonic()
    try:
        config = engine_config(args)
    except ValueError as exc:  # e.g. a parallel topology that cannot be
        print(f"flashserve serve: {exc}", file=sys.stderr)
        return 2
    path = model_path(args.model, args.seed)
    if not (path / "config.json").is_file():
        print(
            f"flashserve serve: {path} is not a checkpoint directory (no config.json)",
            file=sys.stderr,
        )
        return 2
    if config.node_rank > 0:  # a multi-node deployment's other node: worker ranks only
        from flashserve.parallel_args import run_node_workers

        return run_node_workers(config, path, _say)
    refusal = check_memory_plan(args, path)
    if refusal:
        print(f"flashserve serve: {refusal}", file=sys.stderr)
        return 2
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    _say(
        f"loading checkpoint {path} ({weights / 2**20:.1f} MiB) on {config.device}, "
        f"{config.dtype}, quantization {config.quantization}"
    )
    # The loader's one-line summary (bytes per device, s, GB/s) shows without -v; on a
    # terminal its progress bar (stderr) replaces the heartbeat lines.
    logging.getLogger("engine.loader.weight_stream").setLevel(logging.INFO)
    from engine.loader.weight_stream import show_progress

    in_process = in_process_engine(args)
    beat = _Heartbeat("loading the checkpoint", started, enabled=not show_progress(None))
    engine: EngineClient
    with beat:
        # A prefill worker never runs the decoder layers: it does not load them.
        encoder_only = args.role == "prefill"
        if in_process:
            engine = AsyncEngine(config, path, encoder_only=encoder_only)
            where = "in this process"
        else:
            try:
                core = EngineCoreClient(config, path, encoder_only=encoder_only)
            except RuntimeError as exc:
                print(f"flashserve serve: {exc}", file=sys.stderr)
                return 1
            engine = core
            where = f"in process {core.pid}, sockets in {core.socket_dir}"
    fingerprint = "fp_" + checkpoint_fingerprint(path)[:10]
    _say(f"engine ready in {time.monotonic() - started:.1f} s ({where})")
    # uvicorn stops gracefully on SIGINT/SIGTERM, then re-raises the signal. SIGTERM's
    # default action would kill the process before the engine flushes its SSD tier.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        app = create_app(engine, server_settings(args, fingerprint))
        server = uvicorn.Server(uvicorn_config(app, args))
        asyncio.run(_serve(server, args.served_model_name))
    except KeyboardInterrupt:
        pass  # the stop signal, raised again after the graceful shutdown
    finally:
        signal.signal(signal.SIGTERM, previous)
        _say("shutting down the engine")
        engine.shutdown(timeout=args.shutdown_timeout)
    return 0


def check_memory_plan(args: argparse.Namespace, path: Path) -> str | None:
    """Print the memory plan of ``path``'s config on ``--device``; why it cannot start, or None.

    On the topology of the parallel flags (one device without them). The weights
    are planned packed, as the release stores them (engine/planning/memory_plan.py). On
    ``cpu`` the host is the device: its physical memory (or ``--device-memory-gib``),
    less the Engram tables that live in host memory too.
    """
    from engine.model.deepseek_v41.config import ModelConfig
    from engine.planning.memory_plan import GIB, format_plan, memory_plan, weight_bytes

    try:
        model = ModelConfig.from_json(path)
    except (OSError, ValueError) as exc:
        return f"{path / 'config.json'}: {exc}"
    device = args.device
    memory = None if args.device_memory_gib is None else int(args.device_memory_gib * GIB)
    if memory is None:
        from engine.planning.memory_plan import detected_memory_bytes

        memory = detected_memory_bytes(device)
        if memory is not None and device.startswith("cpu"):
            memory -= sum(weight_bytes(model).host.values())
    if memory is None or memory <= 0:
        _say(f"memory plan: cannot tell the memory of {device}; give --device-memory-gib")
        return None
    try:
        from engine.planning.memory_plan import Topology

        topology = Topology(
            args.tensor_parallel_size,
            args.data_parallel_size,
            args.enable_expert_parallel,
            args.nnodes,
        )
        plan = memory_plan(
            model,
            topology.world,
            memory,
            topology=topology,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            page_tokens=args.page_tokens,
            kv_dtype=args.kv_dtype,
        )
    except ValueError as exc:  # a page size the layout cannot hold, a bad memory figure
        return str(exc)
    for line in format_plan(plan):
        _say(line)
    refusal = plan.refusal()
    if refusal:
        return f"{device}: {refusal}"
    pool = plan.device_kinds[0].kv_pool_bytes
    if args.kv_cache_bytes > pool:
        _say(
            f"warning: --kv-cache-bytes {args.kv_cache_bytes:,} exceeds the plan's global-KV "
            f"pool of {pool:,} B on {device}"
        )
    return None


def _role_problem(args: argparse.Namespace) -> str | None:
    """What makes the flags unusable for ``--role``, or None."""
    if args.role in ("prefill", "decode") and not args.kv_dir:
        return f"--role {args.role} needs --kv-dir: the SSD tier is how pages are handed over"
    if args.role == "router" and not (args.prefill_url and args.decode_url):
        return "--role router needs at least one --prefill-url and one --decode-url"
    if args.role != "router" and (args.prefill_url or args.decode_url):
        return "--prefill-url and --decode-url are flags of --role router"
    return None


def _run_router(args: argparse.Namespace) -> int:
    """The front end of a split deployment: no model, no engine."""
    import asyncio

    import uvicorn

    from server.disagg.router import RouterSettings, create_router_app

    router = RouterSettings(
        prefill_urls=tuple(args.prefill_url),
        decode_urls=tuple(args.decode_url),
        prefill_timeout_s=args.prefill_timeout,
        decode_timeout_s=args.decode_timeout,
        routing=args.routing,
        affinity_slack=args.affinity_slack,
    )
    _say(
        f"routing: prefill {', '.join(router.prefill_urls)}; decode {', '.join(router.decode_urls)}"
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        app = create_router_app(server_settings(args, "fp_router"), router)
        server = uvicorn.Server(uvicorn_config(app, args))
        asyncio.run(_serve(server, args.served_model_name))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def _serve(server: uvicorn.Server, model: str) -> None:
    """Run uvicorn; print the URL once it listens (the real port when ``--port 0``)."""
    import asyncio

    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        url = _url(server)
        _say(f"serving {model} at {url} (OpenAI base URL {url}/v1)")
    await task


def _url(server: uvicorn.Server) -> str:
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class _Heartbeat:
    """Says every ``every_s`` seconds that ``what`` is still going (a full checkpoint
    takes minutes to load, and a silent console looks hung)."""

    def __init__(
        self, what: str, started: float, every_s: float = 15.0, *, enabled: bool = True
    ) -> None:
        import threading

        self._what, self._started, self._every_s = what, started, every_s
        self._enabled = enabled
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._done.wait(self._every_s):
            _say(f"{self._what}... {time.monotonic() - self._started:.0f} s")

    def __enter__(self) -> _Heartbeat:
        if self._enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._enabled:
            self._thread.join()


def _say(message: str) -> None:
    print(f"flashserve: {message}", flush=True)
