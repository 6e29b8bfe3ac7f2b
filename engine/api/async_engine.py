"""The engine's one public face: ``AsyncEngine`` (the only thing ``server/`` imports).

``LLMEngine`` runs in its own thread. The asyncio side only puts commands on a
thread-safe queue and awaits per-request ``asyncio.Queue``s that the engine
thread fills with ``loop.call_soon_threadsafe``; it never waits on model
compute. A request whose consumer goes away (the async iterator is closed or
its task cancelled) is aborted, and its pages are freed by the engine thread
before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from engine.api.errors import EngineDeadError, RequestError, RequestFailedError
from engine.api.request import Request, RequestOutput
from engine.config import EngineConfig
from engine.core.llm_engine import EngineStats, LLMEngine
from engine.loader.builder import build_engine

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps on its inbox before checking for shutdown.
_IDLE_WAIT_S = 0.5


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the consumer's loop is closed, so nobody is listening.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill-only request left in the SSD tier for a decode worker.

    ``published_pages``: pages of the prompt's chain durable on SSD, counted
    from the first (a chain is usable up to its first missing page).
    ``hit_tokens``: of those, tokens this worker found cached and did not compute.
    """

    prompt_tokens: int
    published_pages: int
    page_tokens: int
    page_file_bytes: int
    hit_tokens: int

    @property
    def published_bytes(self) -> int:
        """Bytes of page files a decode worker reads to restore them (headers included)."""
        return self.published_pages * self.page_file_bytes


@dataclass(slots=True)
class _Add:
    request: Request
    stream: _Stream


@dataclass(slots=True)
class _Abort:
    request_id: str
    report: bool  # False: the consumer is gone; drop its stream, make no final output


class AsyncEngine:
    """``generate`` / ``abort`` / ``stats`` / ``shutdown`` over an engine thread."""

    def __init__(
        self,
        engine_config: EngineConfig,
        model: str | Path = "tiny",
        *,
        engine: LLMEngine | None = None,
        encoder_only: bool = False,
    ) -> None:
        """Load ``model`` ("tiny" = a seeded random tiny model, or a checkpoint
        directory) and start the engine thread. ``engine``: use a prebuilt engine.
        ``encoder_only``: a prefill worker's engine (see ``build_engine``)."""
        self.config = engine_config
        self.engine = (
            engine
            if engine is not None
            else build_engine(engine_config, model, encoder_only=encoder_only)
        )
        self._inbox: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._active: set[str] = set()  # request ids between generate() and their end
        self._lock = threading.Lock()  # guards _active, _stats, _error
        self._stats = self.engine.stats()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        # Heartbeat: when the engine thread last finished a step or an idle wait
        # (``time.monotonic``); a step that never ends leaves it behind (``stalled_for``).
        self._beat = time.monotonic()
        self._queued_seqs = 0  # sequences handed to the inbox, not yet in the scheduler
        self._thread = threading.Thread(target=self._run, name="flashserve-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ public API
    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream ``request``'s outputs; the last one has ``finished=True``.

        Raises ``RequestError`` for a request that can never run and
        ``EngineDeadError`` if the engine thread has stopped.
        """
        rid = request.request_id
        with self._lock:
            if self._error is not None or self._stopping.is_set():
                raise EngineDeadError("the engine is not running") from self._error
            if rid in self._active:
                raise ValueError(f"request id {rid!r} is already in flight")
            self._active.add(rid)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._queued_seqs += _num_seqs(request)
        self._inbox.put(_Add(request, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    # This request failed alone. Its own fault (a grammar that reached a
                    # dead state) keeps its message; anything else is a server bug whose
                    # text is for the log, not for the client.
                    if isinstance(item.error, RequestError):
                        raise item.error
                    raise RequestFailedError("the request failed in the engine") from item.error
                yield item
                if finished:
                    return
        finally:
            # Closed early, cancelled, or failed: the engine must let go of it.
            if not finished:
                self._inbox.put(_Abort(rid, report=False))
            with self._lock:
                self._active.discard(rid)

    async def prefill(self, request: Request, timeout: float | None = None) -> PrefillResult:
        """Run a prefill-only request and wait until its pages are durable on SSD.

        ``timeout`` bounds the wait for the SSD writes (the prefill itself is
        bounded by the caller cancelling). Pages that did not make it in time
        are simply not counted: a decode worker computes what is missing.
        """
        if not request.prefill_only:
            raise ValueError("prefill() takes a Request with prefill_only=True")
        last: RequestOutput | None = None
        async for out in self.generate(request):
            last = out
        assert last is not None and last.published_pages is not None
        chain = last.published_pages
        # The wait runs off the event loop; the manager's tier is thread-safe.
        pages = await asyncio.to_thread(self.engine.kv.wait_published, chain, timeout)
        kv = self.stats().kv
        return PrefillResult(
            prompt_tokens=len(request.prompt_token_ids),
            published_pages=pages,
            page_tokens=kv.page_tokens,
            page_file_bytes=kv.ssd.file_bytes,
            hit_tokens=last.usage.prompt_cache_hit_tokens,
        )

    def validate(self, request: Request) -> None:
        """Raise ``RequestError`` if ``request`` can never run (the engine checks it again when
        it adds the request; a server calls this first to refuse it before responding)."""
        self.engine.validate(request)

    # The model facts a server needs to build requests (read-only, set at build time).
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_id(self) -> int | None:
        return self.engine.eos_token_id

    def abort(self, request_id: str) -> None:
        """Abort from any thread; a consumer still iterating gets finish reason ``abort``."""
        self._inbox.put(_Abort(request_id, report=True))

    def stats(self) -> EngineStats:
        """The snapshot taken after the engine thread's latest step (never blocks on compute),
        with running and waiting counted now: a long step does not hide new work."""
        with self._lock:
            snapshot, queued = self._stats, self._queued_seqs
        running, waiting = self.engine.queue_lengths()
        return dataclasses.replace(snapshot, running=running, waiting=waiting + queued)

    @property
    def num_active(self) -> int:
        """Requests between ``generate`` and their end (queued, running or finishing)."""
        with self._lock:
            return len(self._active)

    def stalled_for(self) -> float:
        """Seconds since the engine thread last made progress while requests are active
        (0 when idle): what ``/health`` compares with its stall limit."""
        with self._lock:
            if not self._active:
                return 0.0
            beat = self._beat
        return max(0.0, time.monotonic() - beat)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread, end open streams with ``EngineDeadError``, flush KV.

        ``timeout`` bounds the whole: the wait for the engine thread's current step,
        then the SSD flush (run in a thread of its own so a hung disk cannot hold the
        process past it). A thread still in its step at the deadline is left alone
        (closing the KV tier under it would be unsafe) and nothing is flushed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("engine thread busy after %s s; the SSD tier is not flushed", timeout)
            return
        closer = threading.Thread(target=self.engine.close, name="flashserve-close", daemon=True)
        closer.start()
        closer.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if closer.is_alive():
            logger.error("the SSD flush did not finish within the shutdown timeout")

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                # Snapshot first: a consumer holding its final output sees it counted.
                self._snapshot()
                self._beat = time.monotonic()
                self._deliver(outputs)
        except BaseException as exc:  # a failed step poisons every stream
            logger.exception("engine thread failed")
            with self._lock:
                self._error = exc
            self._fail_streams(EngineDeadError(f"engine step failed: {exc!r}"))
            return
        self._fail_streams(EngineDeadError("the engine was shut down"))

    def _drain(self, block: bool) -> None:
        """Apply queued commands; wait for one first if the engine is idle."""
        try:
            cmd = self._inbox.get(timeout=_IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Add):
            rid = cmd.request.request_id
            with self._lock:
                self._queued_seqs -= _num_seqs(cmd.request)
            try:
                self.engine.add_request(cmd.request)
            except Exception as exc:  # a RequestError (add_request validates), or a bug
                cmd.stream.put(exc)
                return
            self._streams[rid] = cmd.stream
        else:
            # Frees pages now; a reported abort's final output comes with the next step.
            self.engine.abort(cmd.request_id, report=cmd.report)
            if not cmd.report:
                self._streams.pop(cmd.request_id, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _snapshot(self) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats

    def _fail_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()


def _num_seqs(request: Request) -> int:
    return 1 if request.prefill_only else request.sampling_params.n
