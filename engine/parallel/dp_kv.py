"""The KV bookkeeping of D data-parallel ranks behind the ``KVManager`` interface.

With DP attention (docs/design/parallelism.md, "Data-parallel attention") each
sequence lives on one DP rank: its global-KV pages, SWA rings and prefix-cache
entries are that rank's, so the node holds the sum of the ranks' pools. The
engine core keeps one ``KVCacheManager`` per DP rank for the page bookkeeping
(block pool, prefix cache); the page bytes live on the ranks' workers, so each
rank's manager moves bytes through a ``StagedPages``: what it loads from SSD
and what it writes behind wait there for the executor's next step.

``place`` picks a waiting sequence's rank before its admission: among the ranks
that can take all its pages, the one whose device tier holds the longest cached
prefix of it; ties (and no hit) go to the rank with the fewest sequences, then
the most free pages. A sequence keeps its rank until ``free`` (finish or
preemption); its next admission places it again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from kvstore.device.device_pool import require_pages
from kvstore.device.layout import KVLayout
from kvstore.device.page_hash import Salt, SpanKey, chain_hashes
from kvstore.manager import KVCacheManager, RestorePlan
from kvstore.ssd.persistent import PersistentStore
from kvstore.stats import KVStats

# Pages restored from SSD into a rank, (device page, bytes); committed chain
# segments whose bytes the rank must hand back, [(page hash, device page)].
Restored = list[tuple[int, bytes]]
Unwritten = list[list[tuple[bytes, int]]]


@dataclass(slots=True)
class StagedPages:
    """``PageBytes`` of one DP rank in the core, whose pool is on the rank's workers.

    A page loaded from SSD is kept as bytes in ``restored`` until the executor
    ships it to the rank's workers with the next step (they copy it in before
    the forward); a committed chain segment waits in ``unwritten`` until the
    executor has fetched its bytes from the rank (``DataParallelKV.write_fetched``).
    """

    store: PersistentStore
    restored: Restored = field(default_factory=list)
    unwritten: Unwritten = field(default_factory=list)

    def load(self, pages: list[tuple[bytes, int]]) -> list[bool]:
        payloads = self.store.get_many([h for h, _ in pages])
        for (_, page), data in zip(pages, payloads, strict=True):
            if data is not None:
                self.restored.append((page, bytes(data)))
        return [data is not None for data in payloads]

    def write_behind(self, chain: list[tuple[bytes, int]]) -> None:
        self.unwritten.append(list(chain))

    @property
    def pending(self) -> bool:
        return bool(self.restored or self.unwritten)

    def take(self) -> tuple[Restored, Unwritten]:
        """(pages to restore into the rank, chain segments whose bytes to fetch)."""
        out = (self.restored, self.unwritten)
        self.restored, self.unwritten = [], []
        return out


class DataParallelKV:
    """``KVManager`` over one ``KVCacheManager`` per DP rank (see the module doc)."""

    def __init__(
        self,
        layout: KVLayout,
        cache_bytes: int,
        data_parallel_size: int,
        kv_dir: str | os.PathLike[str] | None = None,
        kv_dir_bytes: int | None = None,
    ) -> None:
        self.layout = layout
        self.page_tokens = layout.page_tokens
        num_pages = require_pages(layout, cache_bytes)
        # One SSD tier for every rank (content-addressed: any rank may restore any page).
        self.store = PersistentStore(kv_dir, layout, kv_dir_bytes) if kv_dir else None
        # The bytes are the workers'; the core counts pages only.
        self.staged = [
            StagedPages(self.store) if self.store is not None else None
            for _ in range(data_parallel_size)
        ]
        self.ranks = [
            KVCacheManager(layout, num_pages, store=self.store, pages=staged)
            for staged in self.staged
        ]
        self._rank: dict[Hashable, int] = {}

    @property
    def num_pages(self) -> int:
        """Pages one sequence can ever hold: one rank's pool (a sequence never spans two)."""
        return min(m.num_pages for m in self.ranks)

    # ------------------------------------------------------------ placement
    def place(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        need_logits: bool = True,
        *,
        spans: Sequence[SpanKey] = (),
    ) -> int:
        """Choose the rank of a sequence not yet admitted (see the module doc)."""
        current = self._rank.get(request_id)
        if current is not None and self.ranks[current].holds(request_id):
            return current  # admitted already: it stays
        n = len(token_ids)
        cap = max(0, (n - 1) // self.page_tokens) if need_logits else n // self.page_tokens
        hashes = chain_hashes(token_ids, salt, self.page_tokens, n_pages=cap, spans=spans)
        load = [0] * len(self.ranks)
        for rid, r in self._rank.items():
            # Admitted sequences only: a placement of one that never got its pages
            # (still waiting, or aborted while waiting) holds nothing there.
            if rid != request_id and self.ranks[r].holds(rid):
                load[r] += 1

        def score(r: int) -> tuple[bool, int, int, int]:
            m = self.ranks[r]
            hit = m.cached_prefix_pages(hashes)
            return (m.can_allocate(request_id, n), hit, -load[r], m.pool.num_available)

        best = max(range(len(self.ranks)), key=score)
        self._rank[request_id] = best
        if len(self._rank) > 4 * (sum(m.open_requests() for m in self.ranks) + 64):
            self._forget_unadmitted(keep=request_id)
        return best

    def _forget_unadmitted(self, keep: Hashable) -> None:
        """Drop placements of sequences that hold no pages (aborted while waiting)."""
        self._rank = {
            rid: r for rid, r in self._rank.items() if rid == keep or self.ranks[r].holds(rid)
        }

    def pool_of(self, request_id: Hashable) -> int:
        """The DP rank holding ``request_id``'s pages."""
        return self._rank[request_id]

    def _m(self, request_id: Hashable) -> KVCacheManager:
        return self.ranks[self._rank.setdefault(request_id, 0)]

    # ------------------------------------------------------------ routed calls
    def can_allocate(self, request_id: Hashable, n_tokens: int) -> bool:
        return self._m(request_id).can_allocate(request_id, n_tokens)

    def plan_restore(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        *,
        need_logits: bool = True,
        spans: Sequence[SpanKey] = (),
    ) -> RestorePlan:
        return self._m(request_id).plan_restore(
            request_id, token_ids, salt, need_logits=need_logits, spans=spans
        )

    def allocate(self, request_id: Hashable, n_tokens: int) -> list[int]:
        return self._m(request_id).allocate(request_id, n_tokens)

    def block_table(self, request_id: Hashable) -> list[int]:
        return self._m(request_id).block_table(request_id)

    def commit_full_pages(
        self,
        request_id: Hashable,
        token_ids: Sequence[int],
        salt: Salt,
        *,
        spans: Sequence[SpanKey] = (),
    ) -> int:
        return self._m(request_id).commit_full_pages(request_id, token_ids, salt, spans=spans)

    def publish(self, request_id: Hashable) -> list[bytes]:
        raise NotImplementedError("prefill-only requests are not served with parallel serving")

    def wait_published(self, hashes: Sequence[bytes], timeout: float | None = None) -> int:
        return 0 if self.store is None else self.store.wait_written(hashes, timeout)

    def free(self, request_id: Hashable) -> None:
        rank = self._rank.pop(request_id, 0)
        self.ranks[rank].free(request_id)

    # ------------------------------------------------------------ reporting
    def stats(self) -> KVStats:
        """The node's: every count summed over the ranks (capacity is the sum of pools)."""
        parts = [m.stats() for m in self.ranks]
        total = dataclasses.replace(parts[0])  # its ``ssd`` is the one shared tier's
        for f in dataclasses.fields(KVStats):
            if f.name in ("page_tokens", "page_bytes", "ssd"):
                continue
            setattr(total, f.name, sum(getattr(p, f.name) for p in parts))
        return total

    # ------------------------------------------------------------ page traffic
    def take_traffic(self, dp: int) -> tuple[Restored, Unwritten]:
        """DP rank ``dp``'s SSD-tier traffic since the last step: pages restored into it,
        and committed chain segments whose bytes to fetch for writing."""
        staged = self.staged[dp]
        return staged.take() if staged is not None else ([], [])

    def has_traffic(self) -> bool:
        return any(s is not None and s.pending for s in self.staged)

    def write_fetched(self, segments: Unwritten, rows: dict[int, bytes]) -> None:
        """Queue the SSD writes of committed chain segments whose page bytes came back."""
        assert self.store is not None
        for segment in segments:
            pages = [
                (h, torch.frombuffer(bytearray(rows[p]), dtype=torch.uint8)) for h, p in segment
            ]
            self.store.put_chain(pages)

    def flush(self) -> None:
        """Wait for queued SSD writes (pages still on the workers are the executor's)."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
