"""``flashserve serve``: load a checkpoint, start the engine, serve the API with uvicorn.

``--model tiny`` is the built-in tiny checkpoint: written once with
``make_tiny`` into the cache directory and then loaded like any checkpoint, so
serving it runs the real loader and the real tokenizer file. The cache
directory is ``$FLASHSERVE_CACHE``, else ``$XDG_CACHE_HOME/flashserve``, else
``~/.cache/flashserve``; the checkpoint is ``tiny-seed{SEED}`` inside it.

The flags are the fields of ``ServeOptions`` (below), ``RouterSettings``,
``ServerSettings`` and ``EngineConfig``, generated from them
(flashserve/config_args.py); only the flags that are no field one to one are
tables here, beside the function that reads them.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import uvicorn

    from engine.api.core_client import EngineClient
    from engine.config import EngineConfig
    from server.disagg.settings import RouterSettings
    from server.openai.pricing import PriceTable
    from server.settings import ServerSettings

NAME = "serve"
HELP = "serve the OpenAI/DeepSeek-compatible API (--model tiny or a checkpoint directory)"

CACHE_ENV = "FLASHSERVE_CACHE"
# Set to 1 (true, yes): the engine core runs in the API process (--in-process-engine).
IN_PROCESS_ENV = "FLASHSERVE_IN_PROCESS_ENGINE"
# The drain's last seconds (at most half of it): the open requests, ended with a 503,
# finish their responses before uvicorn cancels what is left (a body still arriving).
END_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """What the serve process decides itself: its role, the checkpoint, the listening
    socket, where the engine core runs. Its flags are generated like the configs'."""

    role: Literal["both", "prefill", "decode", "router"] = field(
        default="both",
        metadata={
            "help": "both: one colocated server (default); prefill / decode: a worker of a "
            "split deployment, sharing --kv-dir with the other pool; router: the split "
            "deployment's front end (no model; see --prefill-url, --decode-url)"
        },
    )
    model: str = field(
        default="tiny",
        metadata={
            "help": "'tiny' (built-in random checkpoint), 'demo' (the trained models/demo) or a "
            "checkpoint dir"
        },
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"group": "http", "help": "listen address (default %(default)s)"},
    )
    port: int = field(
        default=8000, metadata={"group": "http", "help": "listen port; 0 = any free port"}
    )
    log_level: str = field(
        default="info",
        metadata={"group": "http", "help": "uvicorn log level (default %(default)s)"},
    )
    header_timeout_s: float = field(
        default=10.0,
        metadata={
            "group": "limits",
            "flag": "--header-timeout",
            "help": "seconds a connection may take to send a request's headers; then 408 "
            "(default %(default)s)",
        },
    )
    shutdown_timeout_s: float = field(
        default=20.0,
        metadata={
            "group": "limits",
            "flag": "--shutdown-timeout",
            "help": "on SIGTERM/SIGINT: seconds to drain open requests (those still open 2 s "
            "before its end get a 503 'shutting down'; a stream: its error event and [DONE]), "
            "then as long again at most to stop the engine and flush the SSD tier "
            "(default %(default)s)",
        },
    )
    in_process_engine: bool = field(
        default=False,
        metadata={
            "group": "engine",
            "help": "run the engine core (scheduler and model loop) in a thread of the API "
            f"process instead of a process of its own (also {IN_PROCESS_ENV}=1; "
            "docs/design/engine.md, 'Process layout')",
        },
    )
    device_memory_gib: float | None = field(
        default=None,
        metadata={
            "group": "engine",
            "help": "memory of the device in GiB for the start-up memory plan (default: the "
            "CUDA device's total memory; for cpu the host's, less the Engram tables it also "
            "holds); serve refuses to start when the weights and the reserve do not fit",
        },
    )


# The argument groups of --help, in order; None is the parser itself.
GROUPS = {
    "http": "HTTP",
    "cost": "cost (server/openai/pricing.py): usage.cost and cost counters",
    "limits": "limits and timeouts (docs/design/hardening.md)",
    "split": "split deployment (docs/design/disaggregation.md)",
    "engine": "engine (EngineConfig)",
    "parallel": "parallel serving (docs/design/parallelism.md)",
}

# Flags that are no config field one to one, each with the function that reads them.
# price_table: the cost flags compose one PriceTable (ServerSettings.prices).
_COST_FLAGS: dict[str, dict[str, Any]] = {
    "--prices": {
        "metavar": "HIT,MISS,OUTPUT",
        "help": "prices per million tokens: cache-hit input, cache-miss input, output",
    },
    "--off-peak-window": {
        "metavar": "HH:MM-HH:MM",
        "help": "UTC window priced at --off-peak-discount (may wrap midnight, e.g. 16:30-00:30)",
    },
    "--off-peak-discount": {
        "type": float,
        "default": 0.0,
        "help": "fraction off every price in the off-peak window (0.5 = half price)",
    },
    "--currency": {"default": "USD", "help": "currency of --prices (default %(default)s)"},
    "--price-file": {
        "help": "JSON price table instead of the flags above (docs/metrics.md, 'Cost')",
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag: the fields of ServeOptions, RouterSettings, ServerSettings and
    EngineConfig, and the compound ones above, in the groups of ``GROUPS``."""
    from engine.config import EngineConfig
    from flashserve.config_args import add_flags, flags_of
    from flashserve.parallel_args import torchrun_defaults
    from server.disagg.settings import RouterSettings
    from server.settings import ServerSettings

    groups: dict[str | None, Any] = {None: parser}
    groups.update((key, parser.add_argument_group(title)) for key, title in GROUPS.items())
    # Within a group, flags appear in the order added: the process's own first.
    add_flags(groups, flags_of(ServeOptions))
    for option, kwargs in _COST_FLAGS.items():
        groups["cost"].add_argument(option, **kwargs)
    add_flags(groups, flags_of(RouterSettings, group="split"))
    add_flags(groups, flags_of(ServerSettings, group="http"))
    add_flags(groups, flags_of(EngineConfig, group="engine", defaults=torchrun_defaults()))


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The ``ServeOptions`` the flags describe."""
    from flashserve.config_args import from_args

    return from_args(ServeOptions, args)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` the flags describe."""
    from engine.config import EngineConfig
    from flashserve.config_args import from_args

    return from_args(EngineConfig, args)


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
    from flashserve.config_args import from_args
    from server.settings import ServerSettings, collect_api_keys

    return from_args(
        ServerSettings,
        args,
        api_keys=collect_api_keys(args.api_keys, os.environ if env is None else env),
        system_fingerprint=fingerprint,
        role=args.role if args.role != "router" else "both",
        max_concurrent_sequences=args.max_concurrent_sequences or None,  # 0: no limit
        prices=price_table(args),
    )


def router_settings(args: argparse.Namespace) -> RouterSettings:
    """The ``RouterSettings`` of ``--role router``'s flags."""
    from flashserve.config_args import from_args
    from server.disagg.settings import RouterSettings

    return from_args(RouterSettings, args)


def uvicorn_config(app: object, options: ServeOptions) -> uvicorn.Config:
    """uvicorn's settings: the address, and the bounds on slow clients and on shutdown."""
    import uvicorn

    from server.http.timeouts import header_timeout_protocol

    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        http=header_timeout_protocol(options.header_timeout_s),
        # Drain: open requests get this long after the stop signal; near its end they are
        # ended with a 503 (_end_after_drain), and what still runs then is cancelled.
        timeout_graceful_shutdown=options.shutdown_timeout_s,  # type: ignore[arg-type]
    )


def price_table(args: argparse.Namespace) -> PriceTable | None:
    """The price table ``--price-file`` or ``--prices`` gives; None without either."""
    from server.openai.pricing import PriceTable

    if args.price_file and args.prices:
        raise ValueError("give --prices or --price-file, not both")
    try:
        if args.price_file:
            return PriceTable.from_file(args.price_file)
    except OSError as exc:
        raise ValueError(f"--price-file: {exc}") from None
    if args.prices:
        return PriceTable.from_flags(
            args.prices,
            off_peak_window=args.off_peak_window,
            off_peak_discount=args.off_peak_discount,
            currency=args.currency,
        )
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
    """Serve until SIGINT / SIGTERM; 2 when the flags or the checkpoint cannot be served."""
    options = serve_options(args)
    problem = _role_problem(args)
    if problem:
        return _refuse(problem)
    if options.role == "router":
        return _run_router(args, options)
    started = time.monotonic()
    try:
        config = engine_config(args)
    except ValueError as exc:  # e.g. a parallel topology that cannot be
        return _refuse(str(exc))
    path = model_path(options.model, config.seed)
    if not (path / "config.json").is_file():
        return _refuse(f"{path} is not a checkpoint directory (no config.json)")
    if config.node_rank > 0:  # a multi-node deployment's other node: worker ranks only
        from flashserve.parallel_args import run_node_workers

        return run_node_workers(config, path, _say)
    refusal = check_memory_plan(config, path, options.device_memory_gib)
    if refusal:
        return _refuse(refusal)
    from engine.loader.builder import checkpoint_fingerprint

    try:  # every server setting (prices included) is checked before anything loads
        settings = server_settings(args, "fp_" + checkpoint_fingerprint(path)[:10])
    except ValueError as exc:
        return _refuse(str(exc))
    in_process = in_process_engine(args)
    try:
        engine = _start_engine(config, path, options.role, in_process, started)
    except RuntimeError as exc:
        if in_process:
            raise
        print(f"flashserve serve: {exc}", file=sys.stderr)  # the core process did not start
        return 1
    from server.app import create_app

    try:
        _serve_until_stopped(lambda: create_app(engine, settings), options, args.served_model_name)
    finally:
        _say("shutting down the engine")
        engine.shutdown(timeout=options.shutdown_timeout_s)
    return 0


def _start_engine(
    config: EngineConfig, path: Path, role: str, in_process: bool, started: float
) -> EngineClient:
    """Load ``path`` into an engine core, in this process or in a process of its own."""
    from engine.api.async_engine import AsyncEngine
    from engine.api.core_client import EngineCoreClient
    from engine.loader.weight_stream import show_progress

    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    _say(
        f"loading checkpoint {path} ({weights / 2**20:.1f} MiB) on {config.device}, "
        f"{config.dtype}, quantization {config.quantization}"
    )
    # The loader's one-line summary (bytes per device, s, GB/s) shows without -v; on a
    # terminal its progress bar (stderr) replaces the heartbeat lines.
    logging.getLogger("engine.loader.weight_stream").setLevel(logging.INFO)
    engine: EngineClient
    with _Heartbeat("loading the checkpoint", started, enabled=not show_progress(None)):
        # A prefill worker never runs the decoder layers: it does not load them.
        encoder_only = role == "prefill"
        if in_process:
            engine = AsyncEngine(config, path, encoder_only=encoder_only)
            where = "in this process"
        else:
            core = EngineCoreClient(config, path, encoder_only=encoder_only)
            where = f"in process {core.pid}, sockets in {core.socket_dir}"
            engine = core
    _say(f"engine ready in {time.monotonic() - started:.1f} s ({where})")
    return engine


def _serve_until_stopped(make_app: Callable[[], object], options: ServeOptions, model: str) -> None:
    """Serve ``make_app()`` (the API of ``model``) with uvicorn until SIGINT or SIGTERM.

    uvicorn stops gracefully on either signal, then re-raises it. SIGTERM's default
    action would kill the process before the engine flushes its SSD tier.
    """
    import asyncio

    import uvicorn

    from server.app import end_open_requests

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        app = make_app()
        server = uvicorn.Server(uvicorn_config(app, options))
        end = functools.partial(end_open_requests, app)  # type: ignore[arg-type]
        asyncio.run(_serve(server, model, end, drain_before_ending(options.shutdown_timeout_s)))
    except KeyboardInterrupt:
        pass  # the stop signal, raised again after the graceful shutdown
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_memory_plan(
    config: EngineConfig, path: Path, device_memory_gib: float | None = None
) -> str | None:
    """Print the memory plan of ``path``'s config on ``config.device``; why it cannot start,
    or None.

    On the topology of the parallel flags (one device without them). The weights
    are planned packed, as the release stores them (engine/planning/memory_plan.py). On
    ``cpu`` the host is the device: its physical memory (or ``device_memory_gib``),
    less the Engram tables that live in host memory too.
    """
    from engine.model.deepseek_v41.config import ModelConfig
    from engine.planning.memory_plan import GIB, format_plan, memory_plan, weight_bytes

    try:
        model = ModelConfig.from_json(path)
    except (OSError, ValueError) as exc:
        return f"{path / 'config.json'}: {exc}"
    device = config.device
    memory = None if device_memory_gib is None else int(device_memory_gib * GIB)
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
            config.tensor_parallel_size,
            config.data_parallel_size,
            config.enable_expert_parallel,
            config.nnodes,
        )
        plan = memory_plan(
            model,
            topology.world,
            memory,
            topology=topology,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            page_tokens=config.page_tokens,
            kv_dtype=config.kv_dtype,
        )
    except ValueError as exc:  # a page size the layout cannot hold, a bad memory figure
        return str(exc)
    for line in format_plan(plan):
        _say(line)
    refusal = plan.refusal()
    if refusal:
        return f"{device}: {refusal}"
    pool = plan.device_kinds[0].kv_pool_bytes
    if config.kv_cache_bytes > pool:
        _say(
            f"warning: --kv-cache-bytes {config.kv_cache_bytes:,} exceeds the plan's global-KV "
            f"pool of {pool:,} B on {device}"
        )
    return None


def _role_problem(args: argparse.Namespace) -> str | None:
    """What makes the flags unusable for ``--role``, or None."""
    if args.role in ("prefill", "decode") and not args.kv_dir:
        return f"--role {args.role} needs --kv-dir: the SSD tier is how pages are handed over"
    if args.role == "router" and not (args.prefill_urls and args.decode_urls):
        return "--role router needs at least one --prefill-url and one --decode-url"
    if args.role != "router" and (args.prefill_urls or args.decode_urls):
        return "--prefill-url and --decode-url are flags of --role router"
    return None


def _run_router(args: argparse.Namespace, options: ServeOptions) -> int:
    """The front end of a split deployment: no model, no engine."""
    from server.disagg.router import create_router_app

    try:
        router = router_settings(args)
        settings = server_settings(args, "fp_router")
    except ValueError as exc:
        return _refuse(str(exc))
    _say(
        f"routing: prefill {', '.join(router.prefill_urls)}; decode {', '.join(router.decode_urls)}"
    )
    _serve_until_stopped(
        lambda: create_router_app(settings, router), options, settings.served_model_name
    )
    return 0


def _refuse(problem: str) -> int:
    """Exit status 2: the flags (or the checkpoint) cannot be served."""
    print(f"flashserve serve: {problem}", file=sys.stderr)
    return 2


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def _serve(
    server: uvicorn.Server, model: str, end_requests: Callable[[], int], drain_s: float
) -> None:
    """Run uvicorn; print the URL once it listens (the real port when ``--port 0``); end
    the open requests ``drain_s`` after the stop signal (``_end_after_drain``)."""
    import asyncio

    task = asyncio.create_task(server.serve())
    drain = asyncio.create_task(_end_after_drain(server, end_requests, drain_s))
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            url = _url(server)
            _say(f"serving {model} at {url} (OpenAI base URL {url}/v1)")
        await task
    finally:
        drain.cancel()


def drain_before_ending(shutdown_timeout_s: float) -> float:
    """Seconds after the stop signal that open requests end with a 503: the drain less
    its grace (``END_GRACE_S``, at most half the drain), so the ended responses finish
    before uvicorn's deadline and the drain stays within ``--shutdown-timeout``."""
    return shutdown_timeout_s - min(END_GRACE_S, shutdown_timeout_s / 2)


async def _end_after_drain(
    server: uvicorn.Server, end_requests: Callable[[], int], drain_s: float
) -> None:
    """Once uvicorn is told to stop, wait ``drain_s``, then end every request still open
    with a 503 in its API's shape. uvicorn's own deadline is later by the grace, so a
    stream ends with its error event and end marker, not a body cut by a cancel."""
    import asyncio

    while not server.should_exit:  # set by uvicorn's signal handler
        await asyncio.sleep(0.05)
    await asyncio.sleep(drain_s)
    ended = end_requests()
    if ended:
        _say(f"shutdown: ended {ended} open request(s) with 503 after {drain_s:g} s of drain")


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
