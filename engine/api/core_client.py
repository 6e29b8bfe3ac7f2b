"""``EngineCoreClient``: the multi-process ``EngineClient`` (``engine/api/protocol.py``).

The API process (HTTP, tokenising, SSE, JSON) and the engine core process
(scheduling, the step loop, detokenising with stop strings) share no GIL.
They talk over two ZeroMQ PUSH/PULL sockets in a private temporary directory
(``ipc://``), messages in msgpack (``engine/api/core_protocol.py``). The client
binds both sockets and spawns the core (``engine/core/core_process.py``), then
waits for its ``ReadyMsg``: the request limits, EOS id, tokenizer and first
stats. The core runs the same ``EngineCore`` loop as the in-process client; its
sink sends one ``StepMsg`` per engine step, which this client's receiver
thread turns back into the sink call the loop made (``on_step`` and friends,
``engine/api/stream.py``), so outputs reach their streams as they do in-process.

Failure: when the core process exits (killed, or a step raised), the
receiver notices within ``_POLL_S``, every open stream ends with
``EngineDeadError`` and every new request is refused with it (the server's
503); ``is_running`` turns False, so ``/health`` fails. Sends never block:
a core that is gone cannot stall the event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import zmq
from tokenizers import Tokenizer

from engine.api import core_protocol as wire
from engine.api.errors import EngineDeadError
from engine.api.model_vision import ModelVision, model_vision
from engine.api.request import Request
from engine.api.stream import StreamingClient
from engine.config import EngineConfig
from engine.core.core_process import CoreSpec, log_levels, run_core

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the receiver checks that the core still lives
DEFAULT_START_TIMEOUT_S = 1800.0  # a full checkpoint takes minutes to load


class EngineCoreClient(StreamingClient):
    """``generate`` / ``prefill`` / ``abort`` / ``stats`` / ``shutdown`` over a core process."""

    # The core refused an add (``LLMEngine.add_request`` raised ``ValueError``): as in-process,
    # the caller gets that ``ValueError``.

    def __init__(
        self,
        engine_config: EngineConfig,
        model: str | Path = "tiny",
        *,
        encoder_only: bool = False,
        torch_threads: int | None = None,
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        """Spawn the core for ``model`` ("tiny" or a checkpoint directory) and wait until
        it has loaded it. Raises ``RuntimeError`` if the core fails or exits first."""
        self.config = engine_config
        # Read here from the config the core loads (a JSON file): the core's ready
        # message need not carry it.
        self._vision = model_vision(model)
        self._dir = tempfile.mkdtemp(prefix="flashserve-core-")
        self._zmq = zmq.Context()
        self._out = self._zmq.socket(zmq.PUSH)
        self._out.setsockopt(zmq.SNDHWM, 0)  # no limit: a send fails only without a peer
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(f"ipc://{self._dir}/to-core")
        self._in = self._zmq.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(f"ipc://{self._dir}/from-core")
        self._send_lock = threading.Lock()
        self._closed = False  # the sockets are gone (shutdown, or a start that failed)
        spec = CoreSpec(
            config=engine_config,
            model=str(model),
            encoder_only=encoder_only,
            to_core=f"ipc://{self._dir}/to-core",
            from_core=f"ipc://{self._dir}/from-core",
            parent_pid=os.getpid(),
            torch_threads=torch_threads,
            log_levels=log_levels(),
        )
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_core, args=(spec,), name="flashserve-engine-core", daemon=True
        )
        self._proc.start()
        try:
            ready = self._wait_ready(start_timeout)
        except BaseException:
            self._kill()
            self._close_sockets()
            raise
        super().__init__(ready.stats)
        self._limits = ready.limits
        self._eos_token_id = ready.eos_token_id
        self._tokenizer = (
            None if ready.tokenizer_json is None else Tokenizer.from_str(ready.tokenizer_json)
        )
        self._applied_seqs = 0  # as the core last reported it
        self._thread = threading.Thread(
            target=self._receive, name="flashserve-core-rx", daemon=True
        )
        self._thread.start()

    @property
    def pid(self) -> int | None:
        """The core process's id (tests kill it)."""
        return self._proc.pid

    @property
    def socket_dir(self) -> Path:
        return Path(self._dir)

    def validate(self, request: Request) -> None:
        """Raise ``ValueError`` if ``request`` can never run, against the core's limits."""
        self._limits.validate(request)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._limits.vocab_size

    @property
    def max_model_len(self) -> int:
        return self._limits.max_model_len

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def vision(self) -> ModelVision | None:
        return self._vision

    @property
    def is_running(self) -> bool:
        with self._lock:
            ok = self._error is None and not self._stopping
        return ok and self._proc.is_alive()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the core (it flushes its SSD tier first), end open streams with
        ``EngineDeadError``, remove the socket files. A core still busy at ``timeout``
        is killed (its SSD write-behind is then lost, as in-process)."""
        with self._lock:
            already = self._stopping
            self._stopping = True
        if already:
            return
        self._send_quietly(wire.ShutdownMsg())
        self._proc.join(timeout)
        if self._proc.is_alive():
            logger.error("engine core busy after %s s; killing it (SSD tier not flushed)", timeout)
            self._kill()
        self._thread.join(5.0)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._close_sockets()

    # ------------------------------------------------------------ the transport
    def _submit(self, request: Request, publish_timeout: float | None) -> None:
        self._send(wire.ENCODER.encode(wire.add_msg(request, publish_timeout)))

    def _withdraw(self, request_id: str, report: bool) -> None:
        self._send_quietly(wire.AbortMsg(request_id, report))

    def _queue_now(self) -> tuple[int, int, int]:
        with self._lock:
            return self._stats.running, self._stats.waiting, self._applied_seqs

    def _send(self, msg: bytes) -> None:
        with self._send_lock:
            if self._closed:
                raise EngineDeadError("the engine core is not reachable")
            try:
                self._out.send(msg, zmq.NOBLOCK, copy=False)
            except zmq.Again:  # no peer: the core is gone
                raise EngineDeadError("the engine core is not reachable") from None

    def _send_quietly(self, msg: object) -> None:
        with contextlib.suppress(EngineDeadError, zmq.ZMQError):
            self._send(wire.ENCODER.encode(msg))

    def _wait_ready(self, timeout: float) -> wire.ReadyMsg:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._in.poll(int(_POLL_S * 1000)):
                msg = wire.FROM_CORE.decode(self._in.recv())
                if isinstance(msg, wire.ReadyMsg):
                    return msg
                if isinstance(msg, wire.DeadMsg):
                    raise RuntimeError(msg.message)
            elif not self._proc.is_alive():
                raise RuntimeError(
                    f"the engine core exited while starting (exit code {self._proc.exitcode})"
                )
        raise RuntimeError(f"the engine core did not start within {timeout:g} s")

    # ------------------------------------------------------------ receiver thread
    def _receive(self) -> None:
        """Route each message until the core is gone or shut down."""
        while True:
            try:
                ready = self._in.poll(int(_POLL_S * 1000))
            except zmq.ZMQError:
                return
            if not ready:
                if not self._proc.is_alive():
                    with self._lock:
                        stopping = self._stopping
                    if not stopping:
                        code = self._proc.exitcode
                        self._core_died(f"the engine core process exited (exit code {code})")
                    return
                continue
            self._dispatch(wire.FROM_CORE.decode(self._in.recv(copy=False).buffer))

    def _dispatch(self, msg: wire.FromCore) -> None:
        """One message of the core's sink, as the same call in-process makes."""
        if isinstance(msg, wire.StepMsg):
            with self._lock:
                self._applied_seqs = msg.applied_seqs
            outputs = [wire.output_of(w) for w in msg.outputs]
            self.on_step(outputs, msg.stats, msg.applied_seqs)
        elif isinstance(msg, wire.QueueMsg):
            with self._lock:
                self._stats = dataclasses.replace(
                    self._stats, running=msg.running, waiting=msg.waiting
                )
                self._applied_seqs = msg.applied_seqs
        elif isinstance(msg, wire.PublishedMsg):
            self.on_published(msg.request_id, msg.pages)
        elif isinstance(msg, wire.DeadMsg):
            self._core_died(msg.message)

    def _core_died(self, message: str) -> None:
        logger.error("%s", message)
        error = EngineDeadError(message)
        self._die(error, error)

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5.0)

    def _close_sockets(self) -> None:
        # Under the send lock: a stream closing on the event loop sends its abort
        # while shutdown runs on another thread, and a socket must not be used while
        # its context is destroyed (zmq's term then waits forever).
        with self._send_lock:
            self._closed = True
            self._zmq.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)
