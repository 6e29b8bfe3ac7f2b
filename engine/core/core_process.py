"""The engine core process: the scheduling + model loop, alone with its GIL.

``run_core`` is the process's main (started by ``EngineCoreClient`` with the
``spawn`` method). It builds the engine, says ``ReadyMsg``, then loops:
take every queued message, run one step, send one ``StepMsg`` with all of
that step's outputs and the stats snapshot. Idle, it waits on its socket and
sends a heartbeat every ``IDLE_BEAT_S`` (so the API side can tell a live idle
core from a wedged one). The API process owns the socket files; the core
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
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from engine.api import core_protocol as wire
from engine.api.request import RequestOutput
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine

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


@dataclass(slots=True)
class _Core:
    engine: LLMEngine
    out: zmq.Socket
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    applied_seqs: int = 0
    publish_timeouts: dict[str, float | None] = field(default_factory=dict)
    last_sent: float = 0.0
    queue_reported: tuple[int, int] = (0, 0)

    def send_step(self, outputs: list[RequestOutput]) -> None:
        stats = self.engine.stats()
        self.queue_reported = (stats.running, stats.waiting)
        self.send(wire.StepMsg([wire.wire_output(o) for o in outputs], stats, self.applied_seqs))

    def report_queue(self) -> None:
        lengths = self.engine.queue_lengths()
        if lengths != self.queue_reported:
            self.queue_reported = lengths
            self.send(wire.QueueMsg(*lengths, self.applied_seqs))

    parent_pid: int = 0

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
    core: _Core | None = None
    failure: list[BaseException] = []
    try:
        from engine.loader.builder import build_engine

        model = spec.model if spec.model == "tiny" else Path(spec.model)
        engine = build_engine(spec.config, model, encoder_only=spec.encoder_only)
        core = _Core(engine, out, parent_pid=spec.parent_pid)
        engine.on_scheduled = core.report_queue
        tokenizer = engine.tokenizer
        core.send(
            wire.ReadyMsg(
                limits=engine.limits(),
                eos_token_id=engine.eos_token_id,
                tokenizer_json=None if tokenizer is None else tokenizer.to_str(),
                stats=engine.stats(),
            )
        )

        def loop() -> None:
            try:
                if not _loop(core, inbox, spec.parent_pid):
                    # Nobody is left to remove the socket files: the core does.
                    sockets = Path(spec.to_core.removeprefix("ipc://")).parent
                    shutil.rmtree(sockets, ignore_errors=True)
            except BaseException as exc:
                failure.append(exc)

        worker = threading.Thread(target=loop, name="flashserve-engine")
        worker.start()
        worker.join()
        if failure:
            raise failure[0]
    except BaseException as exc:  # whatever it was, the API side must hear
        logger.exception("engine core failed", exc_info=exc)
        msg = wire.DeadMsg(f"engine core failed: {exc!r}")
        try:
            if core is not None:
                core.send(msg)
            else:
                out.send(wire.ENCODER.encode(msg))
        except (SystemExit, zmq.ZMQError):  # the API process is gone too
            shutil.rmtree(Path(spec.to_core.removeprefix("ipc://")).parent, ignore_errors=True)
        _close(core, ctx)
        os._exit(1)
    _close(core, ctx)


def _close(core: _Core | None, ctx: zmq.Context) -> None:
    if core is not None:
        try:
            core.engine.close()  # flush the SSD tier's write-behind
        except Exception:
            logger.exception("closing the KV tier failed")
    ctx.destroy(linger=2000)


def _loop(core: _Core, inbox: zmq.Socket, parent_pid: int) -> bool:
    """Serve until shutdown (True) or until the API process is gone (False)."""
    engine = core.engine
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    while True:
        if os.getppid() != parent_pid:
            logger.error("the API process is gone; the engine core exits")
            return False
        if not engine.has_unfinished_requests() and not poller.poll(int(IDLE_BEAT_S * 1000)):
            core.send_step([])
            continue
        if not _drain(core, inbox):
            return True
        outputs = engine.step() if engine.has_unfinished_requests() else []
        now = time.monotonic()
        if outputs or now - core.last_sent >= BUSY_BEAT_S:
            core.last_sent = now
            core.send_step(outputs)
        for out in outputs:
            if out.published_pages is not None:
                _wait_published(core, out.request_id, out.published_pages)


def _drain(core: _Core, inbox: zmq.Socket) -> bool:
    """Apply every queued message; False on shutdown."""
    while True:
        try:
            data = inbox.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return True
        msg = wire.TO_CORE.decode(data.buffer)
        if isinstance(msg, wire.ShutdownMsg):
            return False
        if isinstance(msg, wire.AbortMsg):
            core.engine.abort(msg.request_id, report=msg.report)
            core.publish_timeouts.pop(msg.request_id, None)
            continue
        core.applied_seqs += msg.num_seqs
        try:
            core.engine.add_request(wire.request_of(msg))
        except Exception as exc:  # a RequestError (add_request validates), or a bug
            core.send(wire.StepMsg([_failed(msg, exc)], core.engine.stats(), core.applied_seqs))
            continue
        if msg.prefill_only:
            core.publish_timeouts[msg.request_id] = msg.publish_timeout


def _failed(msg: wire.AddMsg, exc: BaseException) -> wire.WireOutput:
    from engine.api.request import RequestMetrics, Usage

    return wire.WireOutput(
        request_id=msg.request_id,
        outputs=[],
        finished=True,
        usage=Usage(prompt_tokens=len(msg.prompt_token_ids)),
        metrics=RequestMetrics(arrival_time=msg.arrival_time),
        prompt_logprobs=None,
        published_pages=None,
        error=wire.wire_error(exc),
    )


def _wait_published(core: _Core, request_id: str, chain: list[bytes]) -> None:
    """Wait for a prefill's SSD writes off the loop; then tell the API side."""
    timeout = core.publish_timeouts.pop(request_id, None)

    def wait() -> None:
        try:
            pages = core.engine.kv.wait_published(chain, timeout)
        except Exception:
            logger.exception("waiting for published pages failed")
            pages = 0
        core.send(wire.PublishedMsg(request_id, pages))

    threading.Thread(target=wait, name="flashserve-publish", daemon=True).start()
