"""KV bookkeeping: which device pages a request holds, what is cached, what a restore brings.

No byte of KV lives here (docs/design/kvstore.md, "Bookkeeping and bytes").
``KVManager`` is the interface the scheduler and ``LLMEngine`` see; it is
implemented once for one rank (``KVCacheManager``, below) and once for the
data-parallel ranks of parallel serving (``engine/parallel/dp_kv.py``). The
page bytes belong to whoever runs the model: a ``DevicePool`` owned by the
runner in one process (``kvstore/device/device_pool.py``), the workers'
pools under parallel serving. The manager reaches them only through
``PageBytes``: "load these SSD page files into these device pages", "write
these committed device pages behind to SSD".

Lifecycle of a request, as the engine drives it:

    plan = kv.plan_restore(rid, prompt_ids, salt)                   # prefix from either tier
    table = kv.allocate(rid, len(prompt_ids))                       # grow to cover the prompt
    ... run the prefill (the engine's replay plan), writing global KV at >= plan.hit_tokens ...
    kv.commit_full_pages(rid, ids_with_kv_written, salt)           # after each step
    kv.free(rid)                                                    # finished or preempted

Full pages are immutable once committed: they may be shared with other
requests and are written behind to the SSD tier. Only the request's last,
partial page is ever written by the engine.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.device.block_pool import BlockPool
from kvstore.device.layout import KVLayout
from kvstore.device.page_hash import ROOT_HASH, Salt, SpanKey, chain_hashes, salt_bytes
from kvstore.ssd.persistent import PersistentStore
from kvstore.stats import KVStats, SSDStats


@dataclass(slots=True)
class RestorePlan:
    """What a request finds in the cache and what the engine still has to run.

    ``page_ids`` are the request's block table for ``[0, hit_tokens)``, already
    resident on the device. Global KV is written only for entries whose group
    starts at or after ``hit_tokens``; which rows the engine replays below it
    is the model's business (docs/design/semantics.md).
    """

    request_id: Hashable
    num_tokens: int
    page_ids: list[int]
    hit_tokens: int
    device_hit_tokens: int
    ssd_hit_tokens: int

    @property
    def miss_tokens(self) -> int:
        """Tokens whose global KV must be computed (the API's cache-miss tokens)."""
        return self.num_tokens - self.hit_tokens


class PageBytes(Protocol):
    """The owner of a pool's page bytes, as the bookkeeping needs it: SSD in and out.

    Chains are ``(page hash, device page)`` pairs: the hash names the SSD page
    file, the page the row of the owner's pool.
    """

    def load(self, pages: list[tuple[bytes, int]]) -> list[bool]:
        """Read each page's file into its device page before the next forward reads it;
        True where the file verified (a False page holds no usable bytes)."""
        ...

    def write_behind(self, chain: list[tuple[bytes, int]]) -> None:
        """Queue committed pages (consecutive, head first) for the SSD tier."""
        ...


class KVManager(Protocol):
    """The bytes-free KV interface of the scheduler and the engine loop.

    ``place`` and ``pool_of`` name the pool a sequence's pages live in: always
    0 with one rank, a DP rank under data-parallel attention (preemption must
    pick a victim in the same pool).
    """

    @property
    def page_tokens(self) -> int: ...

    @property
    def num_pages(self) -> int:
        """Pages one sequence can ever hold."""
        ...

    def place(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        need_logits: bool = True,
        *,
        spans: Sequence[SpanKey] = (),
    ) -> int:
        """Choose the pool of a sequence about to be admitted (before ``can_allocate``)."""
        ...

    def pool_of(self, request_id: Hashable) -> int: ...

    def can_allocate(self, request_id: Hashable, n_tokens: int) -> bool: ...

    def plan_restore(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        *,
        need_logits: bool = True,
        spans: Sequence[SpanKey] = (),
    ) -> RestorePlan:
        """Open the request on its longest cached prefix (device, then SSD pages).

        ``spans``: the sequence's image spans, part of its page hashes
        (``kvstore/device/page_hash.py``); the same ones at every commit."""
        ...

    def allocate(self, request_id: Hashable, n_tokens: int) -> list[int]:
        """Grow the block table to ``n_tokens``; raises ``OutOfPages``."""
        ...

    def block_table(self, request_id: Hashable) -> list[int]: ...

    def commit_full_pages(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        *,
        spans: Sequence[SpanKey] = (),
    ) -> int:
        """Cache the newly full pages whose KV is written; write them behind to SSD."""
        ...

    def publish(self, request_id: Hashable) -> list[bytes]:
        """Write every committed page behind (a prefill worker's hand-over); its chain."""
        ...

    def wait_published(self, hashes: Sequence[bytes], timeout: float | None = None) -> int: ...

    def free(self, request_id: Hashable) -> None:
        """Close the request; its committed pages stay cached."""
        ...

    def stats(self) -> KVStats: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class _Request:
    salt: bytes | None
    block_table: list[int] = field(default_factory=list)
    # Hashes of the committed full pages, a prefix of block_table.
    hashes: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class _Counters:
    lookups: int = 0
    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    ssd_lookup_pages: int = 0
    ssd_hit_tokens: int = 0


class KVCacheManager:
    """``KVManager`` of one pool: block pool, prefix cache, SSD index and restore planning.

    ``store`` is the SSD tier (its index says which page files exist);
    ``pages`` moves page bytes between that tier and the device pool, and is
    required with a store. The manager itself holds block ids and hashes only.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        *,
        store: PersistentStore | None = None,
        pages: PageBytes | None = None,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, not {num_pages}")
        assert store is None or pages is not None, "an SSD tier needs the owner of the bytes"
        self.layout = layout
        self.page_tokens = layout.page_tokens
        self.pool = BlockPool(num_pages)
        self.store = store
        self.pages = pages
        self._requests: dict[Hashable, _Request] = {}
        self._counters = _Counters()

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    # ------------------------------------------------------------ queries
    def holds(self, request_id: Hashable) -> bool:
        """Whether ``request_id`` is open here (planned or allocated, not yet freed)."""
        return request_id in self._requests

    def open_requests(self) -> int:
        return len(self._requests)

    def cached_prefix_pages(self, hashes: Sequence[bytes]) -> int:
        """Leading pages of the chain ``hashes`` resident on the device (no pinning)."""
        for i, h in enumerate(hashes):
            if self.pool.lookup(h) is None:
                return i
        return len(hashes)

    # One pool: every sequence's pages are in pool 0.
    def place(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        need_logits: bool = True,
        *,
        spans: Sequence[SpanKey] = (),
    ) -> int:
        return 0

    def pool_of(self, request_id: Hashable) -> int:
        return 0

    # ------------------------------------------------------------ restore
    def plan_restore(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        *,
        need_logits: bool = True,
        spans: Sequence[SpanKey] = (),
    ) -> RestorePlan:
        """Longest cached prefix from the device tier, extended from SSD; opens the request.

        The hit is capped at ``(len(token_ids) - 1) // page_tokens`` pages so at
        least one token is computed (the engine needs its logits); without
        ``need_logits`` (a prefill-only request) every full page may hit. SSD pages are
        loaded into freshly allocated device pages; if the pool cannot hold them
        all, or one fails verification, the prefix stops there.
        """
        assert request_id not in self._requests, f"request {request_id!r} is already open"
        pt = self.page_tokens
        n = len(token_ids)
        cap = max(0, (n - 1) // pt) if need_logits else n // pt
        hashes = chain_hashes(token_ids, salt, pt, n_pages=cap, spans=spans)
        # Walk the chain: each page from the device if resident, else from SSD.
        page_ids: list[int] = []
        on_device: list[bool] = []
        for h in hashes:
            page = self.pool.lookup(h)
            if page is not None:
                self.pool.share(page)  # pinned now: allocating SSD pages cannot evict it
                page_ids.append(page)
                on_device.append(True)
                continue
            self._counters.ssd_lookup_pages += int(self.store is not None)
            if self.store is None or not self.store.contains(h):
                break
            page_ids.append(-1)
            on_device.append(False)
        keep = len(page_ids)
        from_ssd = [i for i, dev in enumerate(on_device) if not dev]
        if len(from_ssd) > self.pool.num_available:
            keep = from_ssd[self.pool.num_available]  # first SSD page without room
            from_ssd = from_ssd[: self.pool.num_available]
        keep = min(keep, self._load_from_ssd(from_ssd, hashes, page_ids, keep))
        # Pages past a cut go back: device hits stay cached, loaded pages too.
        self.pool.release([p for p in reversed(page_ids[keep:]) if p >= 0])
        page_ids = page_ids[:keep]

        hit = keep * pt
        device_hit = sum(on_device[:keep]) * pt
        self._requests[request_id] = _Request(salt_bytes(salt), page_ids, hashes[:keep])
        c = self._counters
        c.lookups += 1
        c.lookup_tokens += n
        c.device_hit_tokens += device_hit
        c.ssd_hit_tokens += hit - device_hit
        return RestorePlan(
            request_id=request_id,
            num_tokens=n,
            page_ids=list(page_ids),
            hit_tokens=hit,
            device_hit_tokens=device_hit,
            ssd_hit_tokens=hit - device_hit,
        )

    def _load_from_ssd(
        self, chain_idx: list[int], hashes: list[bytes], page_ids: list[int], keep: int
    ) -> int:
        """Load chain pages ``chain_idx`` into new device pages; returns the first failure.

        The manager picks the device pages; the owner of the bytes reads the
        files and copies them in. Reading is part of planning because a file
        that fails verification ends the prefix.
        """
        if not chain_idx:
            return keep
        assert self.pages is not None
        pages = self.pool.allocate(len(chain_idx))
        verified = self.pages.load([(hashes[i], p) for i, p in zip(chain_idx, pages, strict=True)])
        for i, page, ok in zip(chain_idx, pages, verified, strict=True):
            page_ids[i] = page
            if ok:
                # A verified page is a valid cached page even past a cut, so it stays
                # findable after release.
                self.pool.register(page, hashes[i])
            else:
                keep = min(keep, i)
        return keep

    # --------------------------------------------------------- block tables
    def allocate(self, request_id: Hashable, n_tokens: int) -> list[int]:
        """Grow the block table to cover ``n_tokens`` tokens; returns the whole table.

        Raises ``OutOfPages`` (allocating nothing) when the pool cannot supply
        the pages even after evicting every unused cached page.
        """
        req = self._requests.setdefault(request_id, _Request(salt=None))
        need = math.ceil(n_tokens / self.page_tokens) - len(req.block_table)
        if need > 0:
            req.block_table.extend(self.pool.allocate(need))
        return list(req.block_table)

    def can_allocate(self, request_id: Hashable, n_tokens: int) -> bool:
        req = self._requests.get(request_id)
        have = len(req.block_table) if req is not None else 0
        return math.ceil(n_tokens / self.page_tokens) - have <= self.pool.num_available

    def block_table(self, request_id: Hashable) -> list[int]:
        return list(self._requests[request_id].block_table)

    def commit_full_pages(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        *,
        spans: Sequence[SpanKey] = (),
    ) -> int:
        """Hash and cache the request's newly full pages; queue them for the SSD tier.

        ``token_ids`` are the tokens whose KV is written (not a sampled token not
        yet fed back); ``spans`` the request's image spans, as at ``plan_restore``.
        Returns the number of pages committed by this call.
        """
        req = self._requests[request_id]
        s = salt_bytes(salt)
        if req.salt is None:
            req.salt = s
        assert req.salt == s, "a request's cache salt cannot change"
        start = len(req.hashes)
        parent = req.hashes[-1] if req.hashes else ROOT_HASH
        new = chain_hashes(
            token_ids, s, self.page_tokens, parent=parent, first_page=start, spans=spans
        )
        assert start + len(new) <= len(req.block_table), "committing pages never allocated"
        for i, h in enumerate(new, start):
            self.pool.register(req.block_table[i], h)
        req.hashes.extend(new)
        if self.store is not None and new:
            self._write_behind(req, start, start + len(new))
        return len(new)

    def publish(self, request_id: Hashable) -> list[bytes]:
        """Queue every committed page of the request for the SSD tier, restored ones too.

        A page may sit on the device without a file (its write was dropped, or
        the tier evicted it); a prefill worker must still hand it over. Returns
        the request's chain of page hashes, for ``wait_published``.
        """
        req = self._requests[request_id]
        if self.store is not None and req.hashes:
            self._write_behind(req, 0, len(req.hashes))
        return list(req.hashes)

    def _write_behind(self, req: _Request, start: int, end: int) -> None:
        assert self.pages is not None
        chain = zip(req.hashes[start:end], req.block_table[start:end], strict=True)
        self.pages.write_behind(list(chain))

    def wait_published(self, hashes: Sequence[bytes], timeout: float | None = None) -> int:
        """Pages of the chain ``hashes`` durable in the SSD tier, counted from the head,
        once their queued writes are done (or ``timeout`` passes). Thread-safe: it
        touches only the persistent tier, so a server may wait off the engine thread."""
        if self.store is None:
            return 0
        return self.store.wait_written(hashes, timeout)

    def free(self, request_id: Hashable) -> None:
        """Drop the request's references; its cached pages stay resident (LRU)."""
        req = self._requests.pop(request_id)
        self.pool.release(list(reversed(req.block_table)))

    # ---------------------------------------------------------------- report
    def stats(self) -> KVStats:
        c = self._counters
        pool = self.pool
        return KVStats(
            page_tokens=self.page_tokens,
            page_bytes=self.layout.page_bytes,
            device_pages_total=pool.num_pages,
            device_pages_in_use=pool.num_in_use,
            device_pages_cached=len(pool.lru),
            device_pages_free=len(pool.free_list),
            # The pool's bytes: one row of page_bytes per page, wherever it lives.
            device_bytes=pool.num_pages * self.layout.page_bytes,
            device_evictions=pool.evictions,
            lookups=c.lookups,
            lookup_tokens=c.lookup_tokens,
            device_hit_tokens=c.device_hit_tokens,
            ssd_lookup_pages=c.ssd_lookup_pages,
            ssd_hit_tokens=c.ssd_hit_tokens,
            ssd=self.store.stats() if self.store is not None else SSDStats(),
        )

    def flush(self) -> None:
        """Wait for queued SSD writes (tests, shutdown)."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        """Flush write-behind and stop the SSD threads."""
        if self.store is not None:
            self.store.close()

    def __enter__(self) -> KVCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
