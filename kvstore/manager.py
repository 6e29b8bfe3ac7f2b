"""KVCacheManager: the engine's one entry point to every KV byte (docs/design/architecture.md §2.3).

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
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.device.block_pool import BlockPool
from kvstore.device.device_pool import DevicePool, SourcePages, pages_for_bytes
from kvstore.device.layout import KVLayout
from kvstore.device.page_hash import ROOT_HASH, Salt, chain_hashes, salt_bytes
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
    """Device pool, prefix cache, persistent tier and restore planning."""

    def __init__(
        self,
        layout: KVLayout,
        cache_bytes: int,
        device: str = "cpu",
        kv_dir: str | os.PathLike[str] | None = None,
        kv_dir_bytes: int | None = None,
        write_workers: int = 2,
        read_workers: int = 4,
        max_pending_writes: int = 1024,
    ) -> None:
        num_pages = pages_for_bytes(layout, cache_bytes)
        if num_pages < 1:
            raise ValueError(
                f"kv cache of {cache_bytes} bytes holds no page of {layout.page_bytes} bytes"
            )
        self.layout = layout
        self.page_tokens = layout.page_tokens
        self.pool = BlockPool(num_pages)
        self.memory = DevicePool(layout, num_pages, device)
        self.store = (
            PersistentStore(
                kv_dir, layout, kv_dir_bytes, write_workers, read_workers, max_pending_writes
            )
            if kv_dir is not None
            else None
        )
        self._requests: dict[Hashable, _Request] = {}
        self._counters = _Counters()

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    # ------------------------------------------------------------ restore
    def plan_restore(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        *,
        need_logits: bool = True,
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
        hashes = chain_hashes(token_ids, salt, pt, n_pages=cap)
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
        """Load chain pages ``chain_idx`` into new device pages; returns the first failure."""
        if not chain_idx:
            return keep
        assert self.store is not None
        pages = self.pool.allocate(len(chain_idx))
        payloads = self.store.get_many([hashes[i] for i in chain_idx])
        loaded: list[tuple[int, memoryview]] = []
        for i, page, payload in zip(chain_idx, pages, payloads, strict=True):
            page_ids[i] = page
            if payload is None:
                keep = min(keep, i)
            else:
                loaded.append((page, payload))
        if loaded:
            self._write_loaded(loaded)
        # Register after the bytes are in place: a verified page is a valid cached
        # page even past a cut, so it stays findable after release.
        for i, page, payload in zip(chain_idx, pages, payloads, strict=True):
            if payload is not None:
                self.pool.register(page, hashes[i])
        return keep

    def _write_loaded(self, loaded: list[tuple[int, memoryview]]) -> None:
        """Copy the payloads read from SSD into their device pages ``(page, bytes)``."""
        rows = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for _, p in loaded])
        ids = torch.tensor([page for page, _ in loaded], device=self.memory.device)
        self.memory.pages.index_copy_(0, ids, rows.to(self.memory.device))

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

    def commit_full_pages(self, request_id: Hashable, token_ids: Sequence[int], salt: Salt) -> int:
        """Hash and cache the request's newly full pages; queue them for the SSD tier.

        ``token_ids`` are the tokens whose KV is written (not a sampled token not
        yet fed back). Returns the number of pages committed by this call.
        """
        req = self._requests[request_id]
        s = salt_bytes(salt)
        if req.salt is None:
            req.salt = s
        assert req.salt == s, "a request's cache salt cannot change"
        start = len(req.hashes)
        parent = req.hashes[-1] if req.hashes else ROOT_HASH
        new = chain_hashes(token_ids, s, self.page_tokens, parent=parent, first_page=start)
        assert start + len(new) <= len(req.block_table), "committing pages never allocated"
        for i, h in enumerate(new, start):
            self.pool.register(req.block_table[i], h)
        req.hashes.extend(new)
        if self.store is not None and new:
            rows = [self.memory.pages[p] for p in req.block_table[start : start + len(new)]]
            self.store.put_chain(list(zip(new, rows, strict=True)))
        return len(new)

    def publish(self, request_id: Hashable) -> list[bytes]:
        """Queue every committed page of the request for the SSD tier, restored ones too.

        A page may sit on the device without a file (its write was dropped, or
        the tier evicted it); a prefill worker must still hand it over. Returns
        the request's chain of page hashes, for ``wait_published``.
        """
        req = self._requests[request_id]
        if self.store is not None and req.hashes:
            rows = [self.memory.pages[p] for p in req.block_table[: len(req.hashes)]]
            self.store.put_chain(list(zip(req.hashes, rows, strict=True)))
        return list(req.hashes)

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

    # ---------------------------------------------------------------- data
    def page_tensors(self, source_layer: int) -> SourcePages:
        """The device views the engine's kernels read and write for one kv source."""
        return self.memory.source(source_layer)

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
            device_bytes=self.memory.nbytes,
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
