"""The KV bookkeeping of D data-parallel ranks behind the one interface the scheduler uses.

With DP attention (docs/design/parallelism.md, "Data-parallel attention") each
sequence lives on one DP rank: its global-KV pages, SWA rings and prefix-cache
entries are that rank's, so the node holds the sum of the ranks' pools. The
engine core keeps one ``KVCacheManager`` per DP rank for the page bookkeeping
(block pool, prefix cache); the page bytes live on the ranks' workers, so the
core's managers hold their page tensor on the ``meta`` device (no memory).

``place`` picks a waiting sequence's rank before its admission: among the ranks
that can take all its pages, the one whose device tier holds the longest cached
prefix of it; ties (and no hit) go to the rank with the fewest sequences, then
the most free pages. A sequence keeps its rank until ``free`` (finish or
preemption); its next admission places it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

from kvstore.layout import KVLayout
from kvstore.manager import KVCacheManager, RestorePlan
from kvstore.page_hash import Salt, chain_hashes
from kvstore.stats import KVStats


class DataParallelKV:
    """``KVCacheManager``'s engine-facing methods over one manager per DP rank."""

    def __init__(self, layout: KVLayout, cache_bytes: int, data_parallel_size: int) -> None:
        self.layout = layout
        self.page_tokens = layout.page_tokens
        # The bytes are the workers'; the core counts pages only.
        self.ranks = [
            KVCacheManager(layout, cache_bytes, "meta") for _ in range(data_parallel_size)
        ]
        self._rank: dict[Hashable, int] = {}

    @property
    def num_pages(self) -> int:
        """Pages one sequence can ever hold: one rank's pool (a sequence never spans two)."""
        return min(m.num_pages for m in self.ranks)

    @property
    def store(self) -> None:
        return None  # no SSD tier under parallel serving (yet)

    # ------------------------------------------------------------ placement
    def place(
        self, request_id: Hashable, token_ids: Sequence[int], salt: Salt, need_logits: bool = True
    ) -> int:
        """Choose the rank of a sequence not yet admitted (see the module doc)."""
        current = self._rank.get(request_id)
        if current is not None and request_id in self.ranks[current]._requests:
            return current  # admitted already: it stays
        n = len(token_ids)
        cap = max(0, (n - 1) // self.page_tokens) if need_logits else n // self.page_tokens
        hashes = chain_hashes(token_ids, salt, self.page_tokens, n_pages=cap)
        load = [0] * len(self.ranks)
        for rid, r in self._rank.items():
            if rid != request_id:
                load[r] += 1

        def score(r: int) -> tuple[bool, int, int, int]:
            m = self.ranks[r]
            hit = 0
            for h in hashes:
                if m.pool.lookup(h) is None:
                    break
                hit += 1
            return (m.can_allocate(request_id, n), hit, -load[r], m.pool.num_available)

        best = max(range(len(self.ranks)), key=score)
        self._rank[request_id] = best
        return best

    def pool_of(self, request_id: Hashable) -> int:
        """The DP rank holding ``request_id``'s pages."""
        return self._rank[request_id]

    def _m(self, request_id: Hashable) -> KVCacheManager:
        return self.ranks[self._rank.setdefault(request_id, 0)]

    # ------------------------------------------------------------ routed calls
    def can_allocate(self, request_id: Hashable, n_tokens: int) -> bool:
        return self._m(request_id).can_allocate(request_id, n_tokens)

    def plan_restore(
        self, request_id: Hashable, token_ids: Sequence[int], salt: Salt, *, need_logits=True
    ) -> RestorePlan:
        return self._m(request_id).plan_restore(
            request_id, token_ids, salt, need_logits=need_logits
        )

    def allocate(self, request_id: Hashable, n_tokens: int) -> list[int]:
        return self._m(request_id).allocate(request_id, n_tokens)

    def block_table(self, request_id: Hashable) -> list[int]:
        return self._m(request_id).block_table(request_id)

    def commit_full_pages(self, request_id: Hashable, token_ids: Sequence[int], salt: Salt) -> int:
        return self._m(request_id).commit_full_pages(request_id, token_ids, salt)

    def publish(self, request_id: Hashable) -> list[bytes]:
        return self._m(request_id).publish(request_id)

    def wait_published(self, hashes: Sequence[bytes], timeout: float | None = None) -> int:
        return 0

    def free(self, request_id: Hashable) -> None:
        rank = self._rank.pop(request_id, 0)
        self.ranks[rank].free(request_id)

    # ------------------------------------------------------------ reporting
    def stats(self) -> KVStats:
        """The node's: every count summed over the ranks (capacity is the sum of pools)."""
        parts = [m.stats() for m in self.ranks]
        total = dataclasses.replace(parts[0])
        for f in dataclasses.fields(KVStats):
            if f.name in ("page_tokens", "page_bytes", "ssd"):
                continue
            setattr(total, f.name, sum(getattr(p, f.name) for p in parts))
        return total

    def rank_stats(self) -> list[KVStats]:
        return [m.stats() for m in self.ranks]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        for m in self.ranks:
            m.close()
