"""``EngineCoreClient``: ``AsyncEngine``'s API over an engine core in its own process.

The API process (HTTP, tokenising, SSE, JSON) and the engine core process
(scheduling, the model loop, detokenising with stop strings) share no GIL.
They talk over two ZeroMQ PUSH/PULL sockets in a private temporary directory
(``ipc://``), messages in msgpack (``engine/api/core_protocol.py``). The client
binds both sockets and spawns the core (``engine/core/core_process.py``), then
waits for its ``ReadyMsg``: the request limits, EOS id, tokenizer and first
stats. A receiver thread reads one ``StepMsg`` per engine step and hands each
output to its request's ``asyncio.Queue`` on that request's event loop.

Failure: when the core process exits (killed, or a step raised), the
receiver notices within ``_POLL_S``, every open stream ends with
``EngineDeadError`` and every new request is refused with it (the server's
503); ``is_running`` turns False, so ``/health`` fails. Sends never block:
a core that is gone cannot stall the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import zmq
from tokenizers import Tokenizer

from engine.api import core_protocol as wire
from engine.api.async_engine import AsyncEngine, EngineDeadError, PrefillResult, RequestFailedError
from engine.api.errors import RequestError
from engine.api.request import Request, RequestOutput
from engine.config import EngineConfig
from engine.core.core_process import CoreSpec, log_levels, run_core
from engine.core.llm_engine import EngineStats

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # how often the receiver checks that the core still lives
DEFAULT_START_TIMEOUT_S = 1800.0  # a full checkpoint takes minutes to load


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class EngineCoreClient:
    """``generate`` / ``prefill`` / ``abort`` / ``stats`` / ``shutdown`` over a core process."""

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
        self._lock = threading.Lock()  # guards everything below that both threads touch
        self._streams: dict[str, _Stream] = {}
        self._published: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[int]]] = {}
        self._active: set[str] = set()
        self._sent_seqs = 0
        self._applied_seqs = 0
        self._error: EngineDeadError | None = None
        self._stopping = False
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
        self._limits = ready.limits
        self._eos_token_id = ready.eos_token_id
        self._tokenizer = (
            None if ready.tokenizer_json is None else Tokenizer.from_str(ready.tokenizer_json)
        )
        self._stats: EngineStats = ready.stats
        self._beat = time.monotonic()
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

    # ------------------------------------------------------------ public API
    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """As ``AsyncEngine.generate``: outputs until ``finished``; ``RequestError`` for a
        request that can never run, ``EngineDeadError`` once the core is gone."""
        async for out in self._generate(request, None):
            yield out

    async def _generate(
        self, request: Request, publish_timeout: float | None
    ) -> AsyncIterator[RequestOutput]:
        rid = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        msg = wire.ENCODER.encode(wire.add_msg(request, publish_timeout))
        with self._lock:
            if self._error is not None or self._stopping:
                raise EngineDeadError("the engine is not running") from self._error
            if rid in self._active:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._active.add(rid)
            self._streams[rid] = stream
            self._sent_seqs += 1 if request.prefill_only else request.sampling_params.n
        finished = False
        try:
            self._send(msg)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    if isinstance(item.error, RequestError):
                        raise item.error
                    raise RequestFailedError("the request failed in the engine") from item.error
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send_quietly(wire.AbortMsg(rid, report=False))
            with self._lock:
                self._active.discard(rid)
                self._streams.pop(rid, None)

    async def prefill(self, request: Request, timeout: float | None = None) -> PrefillResult:
        """As ``AsyncEngine.prefill``; the core waits for the SSD writes and says how many
        pages of the chain made it."""
        if not request.prefill_only:
            raise ValueError("prefill() takes a Request with prefill_only=True")
        loop = asyncio.get_running_loop()
        published: asyncio.Future[int] = loop.create_future()
        rid = request.request_id
        with self._lock:
            self._published[rid] = (loop, published)
        try:
            last: RequestOutput | None = None
            async for out in self._generate(request, timeout):
                last = out
            assert last is not None and last.published_pages is not None
            pages = await published if last.published_pages else 0
        finally:
            with self._lock:
                self._published.pop(rid, None)
        kv = self.stats().kv
        return PrefillResult(
            prompt_tokens=len(request.prompt_token_ids),
            published_pages=pages,
            page_tokens=kv.page_tokens,
            page_file_bytes=kv.ssd.file_bytes,
            hit_tokens=last.usage.prompt_cache_hit_tokens,
        )

    def validate(self, request: Request) -> None:
        """As ``AsyncEngine.validate``, against the limits the core sent at start-up: a
        server refuses a request that can never run without a round trip."""
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

    def abort(self, request_id: str) -> None:
        """Abort from any thread; a consumer still iterating gets finish reason ``abort``."""
        self._send_quietly(wire.AbortMsg(request_id, report=True))

    def stats(self) -> EngineStats:
        """The core's snapshot after its latest step, with requests sent but not yet
        taken by the core counted as waiting."""
        with self._lock:
            snapshot, queued = self._stats, self._sent_seqs - self._applied_seqs
        return dataclasses.replace(snapshot, waiting=snapshot.waiting + max(0, queued))

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    def stalled_for(self) -> float:
        """Seconds since the core's last message while requests are active (0 when idle);
        an idle core sends a heartbeat, a busy one a message per step."""
        with self._lock:
            if not self._active:
                return 0.0
            beat = self._beat
        return max(0.0, time.monotonic() - beat)

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

    # ------------------------------------------------------------ internals
    def _send(self, msg: bytes) -> None:
        with self._send_lock:
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

    def _receive(self) -> None:
        """Receiver thread: route each message until the core is gone or shut down."""
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
                        self._die(f"the engine core process exited (exit code {code})")
                    return
                continue
            msg = wire.FROM_CORE.decode(self._in.recv(copy=False).buffer)
            if isinstance(msg, wire.StepMsg):
                self._on_step(msg)
            elif isinstance(msg, wire.QueueMsg):
                with self._lock:
                    self._stats = dataclasses.replace(
                        self._stats, running=msg.running, waiting=msg.waiting
                    )
                    self._applied_seqs = msg.applied_seqs
            elif isinstance(msg, wire.PublishedMsg):
                self._on_published(msg)
            elif isinstance(msg, wire.DeadMsg):
                self._die(msg.message)

    def _on_step(self, msg: wire.StepMsg) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        with self._lock:
            self._stats = msg.stats
            self._applied_seqs = msg.applied_seqs
            self._beat = time.monotonic()
            for w in msg.outputs:
                stream = self._streams.get(w.request_id)
                if stream is None:
                    continue
                if w.finished:
                    del self._streams[w.request_id]
                by_loop.setdefault(stream.loop, []).append((stream.queue, wire.output_of(w)))
        # One wake-up per event loop per step, however many requests it holds.
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody listens
                loop.call_soon_threadsafe(_put_all, items)

    def _on_published(self, msg: wire.PublishedMsg) -> None:
        with self._lock:
            entry = self._published.get(msg.request_id)
        if entry is not None:
            loop, fut = entry
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut, msg.pages)

    def _die(self, message: str) -> None:
        logger.error("%s", message)
        error = EngineDeadError(message)
        with self._lock:
            if self._error is None:
                self._error = error
        self._fail_all(error)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            published, self._published = list(self._published.values()), {}
        for stream in streams:
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        for loop, fut in published:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail, fut, error)

    def _kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(5.0)

    def _close_sockets(self) -> None:
        self._zmq.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


def _resolve(fut: asyncio.Future[int], pages: int) -> None:
    if not fut.done():
        fut.set_result(pages)


def _fail(fut: asyncio.Future[int], error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)


# What ``server/`` accepts: the engine in a thread, or the engine core in a process.
EngineClient = AsyncEngine | EngineCoreClient
