"""The engine core process: the scheduling + model loop, alone with its GIL.

``run_core`` is the process's main (started by ``EngineCoreClient`` with the
``spawn`` method). It builds the engine, says ``ReadyMsg``, then runs the
step loop the in-process client runs too (``EngineCore``,
``engine/core/engine_core.py``) with a socket for its inbox and a sink that
sends: every queued message is applied, one step runs, one ``StepMsg`` carries
all of that step's outputs and the stats snapshot. Idle, it waits on its socket
and sends a heartbeat every ``IDLE_BEAT_S`` (so the API side can tell a live
idle core from a wedged one). The API process owns the socket files; the core
connects to them.

The core ignores SIGINT and SIGTERM: the API process drives its shutdown
(``ShutdownMsg``: flush the SSD tier, exit), and a Ctrl-C on the terminal must
not kill it mid-step. If the API process dies without saying so, the core
notices its parent is gone and exits.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from engine.api import core_protocol as wire
from engine.api.request import Request, RequestMetrics, RequestOutput, Usage
from engine.config import EngineConfig
from engine.core.engine_core import (
    AbortRequest,
    AddRequest,
    Command,
    CoreExit,
    EngineCore,
    Shutdown,
)
from engine.core.llm_engine import EngineStats, LLMEngine

logger = logging.getLogger(__name__)

IDLE_BEAT_S = 0.25
# A busy core sends a StepMsg at least this often even when a step made no output
# (long prefill chunks): the API side's heartbeat and stats stay fresh.
BUSY_BEAT_S = 0.1


@dataclass(frozen=True, slots=True)
class CoreSpec:
    """What a core process needs to start (picklable: it crosses the spawn)."""

    config: EngineConfig
    model: str
    encoder_only: bool
    to_core: str  # zmq address the core reads from
    from_core: str  # zmq address the core writes to
    parent_pid: int
    torch_threads: int | None = None
    log_levels: dict[str, int] = field(default_factory=dict)  # "" = the root logger


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # flashserve's CLI format


def log_levels() -> dict[str, int]:
    """This process's root level and the levels set on the project's loggers."""
    levels = {"": logging.getLogger().level}
    for name, lg in logging.root.manager.loggerDict.items():
        ours = name.split(".", 1)[0] in ("engine", "kvstore", "kernels")
        if ours and isinstance(lg, logging.Logger) and lg.level != logging.NOTSET:
            levels[name] = lg.level
    return levels


class _SocketInbox:
    """The loop's inbox: the socket the API process sends ``AddMsg`` / ``AbortMsg`` /
    ``ShutdownMsg`` on, decoded into the loop's commands."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self.poller = zmq.Poller()
        self.poller.register(socket, zmq.POLLIN)

    def next(self, timeout: float) -> Command | None:
        if timeout > 0 and not self.poller.poll(int(timeout * 1000)):
            return None
        try:
            data = self.socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        msg = wire.TO_CORE.decode(data.buffer)
        if isinstance(msg, wire.ShutdownMsg):
            return Shutdown()
        if isinstance(msg, wire.AbortMsg):
            return AbortRequest(msg.request_id, msg.report)
        return AddRequest(wire.request_of(msg), msg.publish_timeout)


@dataclass(slots=True)
class _SocketSink:
    """The loop's sink: each call becomes a message to the API process, whose client
    makes the same call on its side."""

    core: EngineCore
    out: zmq.Socket
    parent_pid: int
    socket_dir: Path
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    queue_reported: tuple[int, int] = (0, 0)

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, applied_seqs: int) -> None:
        self.queue_reported = (stats.running, stats.waiting)
        wired = [wire.wire_output(o) for o in outputs]
        self.send(wire.StepMsg(wired, stats, applied_seqs))

    def on_rejected(self, request: Request, error: Exception, applied_seqs: int) -> None:
        failed = _failed(request, error)
        self.send(wire.StepMsg([failed], self.core.engine.stats(), applied_seqs))

    def on_published(self, request_id: str, pages: int) -> None:
        self.send(wire.PublishedMsg(request_id, pages))

    def on_failed(self, error: BaseException) -> None:
        _say_dead(self, self.out, self.socket_dir, error)

    def report_queue(self) -> None:
        """After scheduling (``LLMEngine.on_scheduled``): running and waiting, if changed."""
        lengths = self.core.engine.queue_lengths()
        if lengths != self.queue_reported:
            self.queue_reported = lengths
            self.send(wire.QueueMsg(*lengths, self.core.applied_seqs))

    def send(self, msg: object) -> None:
        """Send, never blocking for good: a send that times out (the API process stopped
        reading) is retried while that process lives, and the core exits once it is gone."""
        data = wire.ENCODER.encode(msg)
        with self.send_lock:  # publish waiters send from their own threads
            while True:
                try:
                    self.out.send(data, copy=False)
                    return
                except zmq.Again:
                    if os.getppid() != self.parent_pid:
                        raise SystemExit("the API process is gone") from None


def _say_dead(
    sink: _SocketSink | None, out: zmq.Socket, socket_dir: Path, error: BaseException
) -> None:
    """Tell the API process the core failed; if it is gone too, remove the socket files
    (nobody else is left to)."""
    msg = wire.DeadMsg(f"engine core failed: {error!r}")
    try:
        if sink is not None:
            sink.send(msg)
        else:
            out.send(wire.ENCODER.encode(msg))
    except (SystemExit, zmq.ZMQError):
        shutil.rmtree(socket_dir, ignore_errors=True)


def run_core(spec: CoreSpec) -> None:
    """Main of the engine core process.

    The model is loaded on the main thread and stepped on a second one, as the
    in-process engine does: measured on this project's loaded 2-core CI machine,
    steps on the thread that loaded the weights ran 5-20x slower than on another
    thread (the loading thread's intra-op team spinning against the rest of the
    machine), so the two modes must be laid out alike to compare them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The API process's logging, so the core's lines read like the rest of the server's.
    logging.basicConfig(level=spec.log_levels.get("", logging.WARNING), format=LOG_FORMAT)
    for name, level in spec.log_levels.items():
        if name:
            logging.getLogger(name).setLevel(level)
    if spec.torch_threads is not None:
        import torch

        torch.set_num_threads(spec.torch_threads)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(spec.to_core)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.setsockopt(zmq.SNDTIMEO, 1000)
    out.connect(spec.from_core)
    socket_dir = Path(spec.to_core.removeprefix("ipc://")).parent
    engine: LLMEngine | None = None
    sink: _SocketSink | None = None
    try:
        from engine.loader.builder import build_engine

        model = spec.model if spec.model == "tiny" else Path(spec.model)
        engine = build_engine(spec.config, model, encoder_only=spec.encoder_only)
        core = EngineCore(engine, idle_wait_s=IDLE_BEAT_S, beat_s=BUSY_BEAT_S)
        sink = _SocketSink(core, out, spec.parent_pid, socket_dir)
        engine.on_scheduled = sink.report_queue
        _send_ready(sink, engine)
    except BaseException as exc:  # whatever it was, the API side must hear
        logger.exception("engine core failed", exc_info=exc)
        _say_dead(sink, out, socket_dir, exc)
        _close(engine, ctx)
        os._exit(1)
    ended = _serve(core, _SocketInbox(inbox), sink, spec.parent_pid)
    if ended is CoreExit.ORPHANED:
        logger.error("the API process is gone; the engine core exits")
        # Nobody is left to remove the socket files: the core does.
        shutil.rmtree(socket_dir, ignore_errors=True)
    _close(engine, ctx)
    if ended is CoreExit.FAILED:  # the sink has said DeadMsg
        os._exit(1)


def _send_ready(sink: _SocketSink, engine: LLMEngine) -> None:
    tokenizer = engine.tokenizer
    sink.send(
        wire.ReadyMsg(
            limits=engine.limits(),
            eos_token_id=engine.eos_token_id,
            tokenizer_json=None if tokenizer is None else tokenizer.to_str(),
            stats=engine.stats(),
        )
    )


def _serve(core: EngineCore, inbox: _SocketInbox, sink: _SocketSink, parent_pid: int) -> CoreExit:
    """Run the loop on a thread of its own (see ``run_core``) until it ends; it stops by
    itself once the API process is gone (the parent-pid check before every step)."""
    ended: list[CoreExit] = []

    def loop() -> None:
        ended.append(core.run(inbox, sink, alive=lambda: os.getppid() == parent_pid))

    worker = threading.Thread(target=loop, name="flashserve-engine")
    worker.start()
    worker.join()
    return ended[0] if ended else CoreExit.FAILED


def _close(engine: LLMEngine | None, ctx: zmq.Context) -> None:
    if engine is not None:
        try:
            engine.close()  # flush the SSD tier's write-behind
        except Exception:
            logger.exception("closing the KV tier failed")
    ctx.destroy(linger=2000)


def _failed(request: Request, exc: BaseException) -> wire.WireOutput:
    """The one output of a request the core could not add."""
    return wire.WireOutput(
        request_id=request.request_id,
        outputs=[],
        finished=True,
        usage=Usage(prompt_tokens=len(request.prompt_token_ids)),
        metrics=RequestMetrics(arrival_time=request.arrival_time),
        prompt_logprobs=None,
        published_pages=None,
        error=wire.wire_error(exc),
    )
