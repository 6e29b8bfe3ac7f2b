"""Per-request output streams, and the client half both engine clients share.

A ``Stream`` is one request's ``asyncio.Queue`` of ``RequestOutput``s (or the
exception that ends it), filled from another thread with
``loop.call_soon_threadsafe``. ``StreamingClient`` is what ``AsyncEngine`` and
``EngineCoreClient`` do alike on the API side: ``generate`` / ``prefill`` /
``abort`` / ``stats`` / ``num_active`` / ``stalled_for``, and the sink calls of
the step loop (``on_step``, ``on_rejected``, ``on_published``) that route
outputs to their streams. The in-process client receives those calls straight
from the loop's thread; the multi-process client's receiver thread makes them
as it decodes the core's messages. A subclass supplies only the transport
(``_submit``, ``_withdraw``), the live queue counts and ``validate``.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from engine.api.errors import EngineDeadError, RequestError, RequestFailedError
from engine.api.protocol import PrefillResult
from engine.api.request import Request, RequestOutput
from engine.core.engine_core import num_seqs
from engine.core.llm_engine import EngineStats

Item = RequestOutput | BaseException


@dataclass(slots=True)
class Stream:
    """One request's outputs, for a consumer on ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    finished: bool = False  # the consumer has seen the final output
    # The client's count of sequences sent, this request's included: an output the loop
    # reports with fewer sequences applied predates this request (a reused id's
    # predecessor, whose abort the loop had not reached yet) and is not for this stream.
    sent_seqs: int = 0

    def put(self, item: Item) -> None:
        """Queue ``item`` from any thread."""
        post(self.loop, [(self, item)])

    async def next_output(self) -> RequestOutput:
        """The next output. An exception put on the stream is raised; an output's error is
        raised as it is if it is the request's own fault (a ``RequestError``: its message
        is for the client), else as ``RequestFailedError`` (a server bug, whose text is
        for the log)."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self.finished = item.finished
        if item.error is not None:
            if isinstance(item.error, RequestError):
                raise item.error
            raise RequestFailedError("the request failed in the engine") from item.error
        return item


def post(loop: asyncio.AbstractEventLoop, items: list[tuple[Stream, Item]]) -> None:
    """Put ``items`` on their streams with one wake-up of ``loop``."""
    # RuntimeError: the consumer's loop is closed, so nobody is listening.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[Stream, Item]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[int]"]


class StreamingClient(abc.ABC):
    """The API side of an engine client: streams by request id, the heartbeat, stats.

    ``_lock`` guards every attribute below that the consumer's threads and the
    thread delivering outputs both touch."""

    def __init__(self, stats: EngineStats) -> None:
        self._lock = threading.Lock()
        self._submit_lock = threading.Lock()  # held while a request is counted and sent
        self._streams: dict[str, Stream] = {}
        self._published: dict[str, _Waiter] = {}
        self._active: set[str] = set()  # request ids between generate() and their end
        self._sent_seqs = 0  # sequences of every request handed to the transport
        self._stats = stats
        # The cause of the engine's death: new requests are refused with it chained.
        self._error: BaseException | None = None
        self._stopping = False
        # When the loop last reported a step or an idle heartbeat (``time.monotonic``);
        # a step that never ends leaves it behind (``stalled_for``).
        self._beat = time.monotonic()

    # ------------------------------------------------------------ the transport
    @abc.abstractmethod
    def validate(self, request: Request) -> None: ...

    @abc.abstractmethod
    def _submit(self, request: Request, publish_timeout: float | None) -> None:
        """Hand ``request`` to the loop (raise ``EngineDeadError`` if it cannot be reached)."""

    @abc.abstractmethod
    def _withdraw(self, request_id: str, report: bool) -> None:
        """Abort ``request_id`` in the loop, never raising (``report``: make a final output)."""

    @abc.abstractmethod
    def _queue_now(self) -> tuple[int, int, int]:
        """Running and waiting sequences in the scheduler now (as recent as the transport
        knows them), and how many sequences of added requests the loop has taken."""

    # ------------------------------------------------------------ public API
    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream ``request``'s outputs; the last one has ``finished=True``.

        Raises ``ValueError`` for a request that can never run and
        ``EngineDeadError`` once the engine has stopped.
        """
        # aclosing: closing this generator must run the inner one's ``finally`` now.
        async with contextlib.aclosing(self._generate(request, None, None)) as outputs:
            async for out in outputs:
                yield out

    async def _generate(
        self,
        request: Request,
        publish_timeout: float | None,
        published: _Waiter | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        rid = request.request_id
        stream = Stream(asyncio.get_running_loop())
        # Sequences are counted in the order the loop takes the requests (``sent_seqs``).
        with self._submit_lock:
            with self._lock:
                if self._error is not None or self._stopping:
                    raise EngineDeadError("the engine is not running") from self._error
                if rid in self._active:
                    raise ValueError(f"request id {rid!r} is already in flight")
                self._active.add(rid)
                self._streams[rid] = stream
                if published is not None:
                    self._published[rid] = published
                self._sent_seqs += num_seqs(request)
                stream.sent_seqs = self._sent_seqs
            try:
                self._submit(request, publish_timeout)
            except BaseException:
                self._forget(rid, stream)
                raise
        try:
            while not stream.finished:
                yield await stream.next_output()
        finally:
            # Closed early, cancelled, or failed: the engine must let go of it.
            if not stream.finished:
                self._withdraw(rid, report=False)
            self._forget(rid, stream)

    def _forget(self, rid: str, stream: Stream) -> None:
        with self._lock:
            self._active.discard(rid)
            if self._streams.get(rid) is stream:
                del self._streams[rid]

    async def prefill(self, request: Request, timeout: float | None = None) -> PrefillResult:
        """Run a prefill-only request and wait until its pages are durable on SSD.

        ``timeout`` bounds the loop's wait for the SSD writes (the prefill itself is
        bounded by the caller cancelling). Pages that did not make it in time are
        simply not counted: a decode worker computes what is missing.
        """
        if not request.prefill_only:
            raise ValueError("prefill() takes a Request with prefill_only=True")
        loop = asyncio.get_running_loop()
        waiter: _Waiter = (loop, loop.create_future())
        rid = request.request_id
        try:
            last: RequestOutput | None = None
            async with contextlib.aclosing(self._generate(request, timeout, waiter)) as outs:
                async for out in outs:
                    last = out
            assert last is not None and last.published_pages is not None
            pages = await waiter[1] if last.published_pages else 0
        finally:
            with self._lock:
                if self._published.get(rid) is waiter:
                    del self._published[rid]
        kv = self.stats().kv
        return PrefillResult(
            prompt_tokens=len(request.prompt_token_ids),
            published_pages=pages,
            page_tokens=kv.page_tokens,
            page_file_bytes=kv.ssd.file_bytes,
            hit_tokens=last.usage.prompt_cache_hit_tokens,
        )

    def abort(self, request_id: str) -> None:
        """Abort from any thread; a consumer still iterating gets finish reason ``abort``."""
        self._withdraw(request_id, report=True)

    def stats(self) -> EngineStats:
        """The snapshot taken after the loop's latest step (never blocks on compute), with
        running and waiting counted now and requests not yet taken by the loop as waiting:
        a long step does not hide new work."""
        with self._lock:
            snapshot, sent = self._stats, self._sent_seqs
        running, waiting, applied = self._queue_now()
        return dataclasses.replace(
            snapshot, running=running, waiting=waiting + max(0, sent - applied)
        )

    @property
    def num_active(self) -> int:
        """Requests between ``generate`` and their end (queued, running or finishing)."""
        with self._lock:
            return len(self._active)

    def stalled_for(self) -> float:
        """Seconds since the loop last reported progress while requests are active (0 when
        idle): what ``/health`` compares with its stall limit. An idle loop reports a
        heartbeat, a busy one every step (or every few, at least every ``beat_s``)."""
        with self._lock:
            if not self._active:
                return 0.0
            beat = self._beat
        return max(0.0, time.monotonic() - beat)

    # ------------------------------------------------------------ sink calls (other threads)
    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, applied_seqs: int) -> None:
        """A step's outputs: to their streams, one wake-up per event loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Item]]] = {}
        with self._lock:
            self._stats = stats  # first: a consumer holding its final output sees it counted
            self._beat = time.monotonic()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None or stream.sent_seqs > applied_seqs:  # not its consumer's
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            post(loop, items)

    def on_rejected(self, request: Request, error: Exception, applied_seqs: int) -> None:
        """The loop could not add ``request``: its consumer gets ``error``."""
        with self._lock:
            stream = self._streams.get(request.request_id)
            if stream is None or stream.sent_seqs > applied_seqs:
                return
            del self._streams[request.request_id]
        stream.put(error)

    def on_published(self, request_id: str, pages: int) -> None:
        with self._lock:
            waiter = self._published.get(request_id)
        if waiter is not None:
            loop, fut = waiter
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                loop.call_soon_threadsafe(_resolve, fut, pages)

    # ------------------------------------------------------------ ending
    def _die(self, error: EngineDeadError, cause: BaseException) -> None:
        """The engine is gone (``cause``): refuse new requests, fail every open one."""
        with self._lock:
            if self._error is None:
                self._error = cause
        self._fail_all(error)

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            published, self._published = list(self._published.values()), {}
        for stream in streams:
            stream.put(error)
        for loop, fut in published:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail, fut, error)


def _resolve(fut: asyncio.Future[int], pages: int) -> None:
    if not fut.done():
        fut.set_result(pages)


def _fail(fut: asyncio.Future[int], error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
