"""Disk reads for the engine thread, bounded by a deadline.

Why: docs/design/kvstore.md, "Persistent tier" (the read deadline).

The engine plans a restore on its own thread; a read that blocks there (a hung
NFS server, a file swapped for something that never answers) would stop every
request. Reads run on worker threads instead and the caller waits at most
``timeout_s``: what is not done by then is a miss, and the request computes
those pages. A read still running past its deadline is *overdue*; while any is,
later calls do not queue behind it (they would only wait out their own deadline
too) and miss at once, until the stuck read returns.

The workers are daemon threads, unlike ``ThreadPoolExecutor``'s, which the
interpreter joins at exit: a read stuck forever must not keep a stopping
server alive.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger("kvstore.ssd.persistent")

T = TypeVar("T")
R = TypeVar("R")


@dataclass(slots=True)
class ReaderCounters:
    timeouts: int = 0  # calls that reached their deadline with reads unfinished
    skipped: int = 0  # items missed at once because a read was overdue
    overdue: int = 0  # reads running past their deadline now
    failures: int = 0  # reads that raised something other than a miss


class DeadlineReader:
    def __init__(self, workers: int, timeout_s: float, thread_name_prefix: str) -> None:
        if timeout_s <= 0:
            raise ValueError(f"read timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue[tuple[Future[object], Callable[[], object]] | None] = (
            queue.SimpleQueue()
        )
        self._workers = [
            threading.Thread(target=self._work, name=f"{thread_name_prefix}_{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for t in self._workers:
            t.start()
        self._lock = threading.Lock()
        self._counters = ReaderCounters()

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            future, call = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)

    def _submit(self, fn: Callable[[T], R], item: T) -> Future[R]:
        future: Future[R] = Future()
        self._queue.put((future, lambda: fn(item)))  # type: ignore[arg-type]
        return future

    def counters(self) -> ReaderCounters:
        with self._lock:
            c = self._counters
            return ReaderCounters(c.timeouts, c.skipped, c.overdue, c.failures)

    def map(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R | None]:
        """``fn`` over ``items`` in parallel; None for each item not done by the deadline."""
        if not items:
            return []
        with self._lock:
            if self._counters.overdue:
                self._counters.skipped += len(items)
                return [None] * len(items)
        futures = [self._submit(fn, item) for item in items]
        done, late = wait(futures, timeout=self.timeout_s)
        if late:
            self._give_up(late)
        return [self._result(f) if f in done else None for f in futures]

    def _give_up(self, late: set[Future[R]]) -> None:
        stuck = [f for f in late if not f.cancel()]  # queued ones never start
        with self._lock:
            self._counters.timeouts += 1
            self._counters.overdue += len(stuck)
        log.warning(
            "kv persistent tier: %d read(s) not done after %.1f s; served as misses, "
            "and further reads miss until they return",
            len(late),
            self.timeout_s,
        )
        for f in stuck:
            f.add_done_callback(self._returned)

    def _returned(self, _: Future[R]) -> None:
        with self._lock:
            self._counters.overdue -= 1

    def _result(self, future: Future[R]) -> R | None:
        try:
            return future.result()
        except Exception:
            # A bug in a read must not end the caller's request, let alone the engine.
            log.exception("kv persistent tier: a read raised; served as a miss")
            with self._lock:
                self._counters.failures += 1
            return None

    def shutdown(self) -> None:
        """Stop the workers once their current read returns; never waits for it."""
        for _ in self._workers:
            self._queue.put(None)
