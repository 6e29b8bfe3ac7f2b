"""Compiled grammars kept by the engine: an LRU bounded in bytes, one compilation per key.

xgrammar's own cache is keyed by the structural tag, so a hit still pays for
building the tag from the schema (a fifth of a second of Python for a heavy
schema, holding the GIL), and it keeps an entry larger than its whole bound.
This one is keyed by the spec itself, counts each grammar at its
``memory_size_bytes``, never holds more than ``limit_bytes``, and remembers
refusals (a grammar past the size cap, a schema that does not compile) so a
client repeating one does not buy a fresh compilation each time.

Requests for a key that is compiling wait for that compilation instead of
starting their own: three copies of a heavy schema at once compile it once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

# What a remembered refusal counts against the bound (its message and key).
REFUSAL_BYTES = 4096


@dataclass(slots=True)
class GrammarCache(Generic[T]):
    """``get(key, build, size)``: the value for ``key``, built at most once at a time.

    ``build`` runs in the caller's thread (a grammar worker); an exception it raises
    of a ``remembered`` type is kept like a value (``REFUSAL_BYTES``) and raised
    again to every caller of that key until it is evicted; any other reaches the
    callers waiting on this build and is forgotten. ``size(value)`` is the value's bytes; a value
    larger than ``limit_bytes`` is returned but not kept.
    """

    limit_bytes: int
    remembered: tuple[type[BaseException], ...] = ()
    _entries: OrderedDict[Hashable, tuple[Future[T], int]] = field(default_factory=OrderedDict)
    _building: dict[Hashable, Future[T]] = field(default_factory=dict)
    _used: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get(self, key: Hashable, build: Callable[[], T], size: Callable[[T], int]) -> T:
        with self._lock:
            kept = self._entries.get(key)
            if kept is not None:
                self._entries.move_to_end(key)
                return kept[0].result()
            pending = self._building.get(key)
            owner = pending is None
            if pending is None:
                pending = self._building[key] = Future()
        if not owner:
            return pending.result()  # another worker compiles this key; share its result
        try:
            value = build()
        except BaseException as exc:
            pending.set_exception(exc)
            remember = isinstance(exc, self.remembered)
            self._finish(key, pending, REFUSAL_BYTES if remember else self.limit_bytes + 1)
            raise
        pending.set_result(value)
        self._finish(key, pending, size(value))
        return value

    def _finish(self, key: Hashable, done: Future[T], nbytes: int) -> None:
        with self._lock:
            del self._building[key]
            if nbytes > self.limit_bytes:
                return  # too large to keep (or not to be kept): built again next time
            self._entries[key] = (done, nbytes)
            self._used += nbytes
            while self._used > self.limit_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._used -= evicted

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)
