"""Page bookkeeping of the device tier: refcounts, free list, prefix-cache map, LRU.

No tensors here (those live in ``device_pool.py``), so every rule can be
tested alone. A page is in exactly one of three states:

- free: refcount 0, no hash; on the free list.
- in use: refcount > 0 (one count per request holding it in its block table).
- cached: refcount 0 with a hash; resident and findable by ``lookup``, on the
  LRU list, and evicted (its hash forgotten) only when ``allocate`` runs out
  of free pages.

A page in use is never handed out again; only ``allocate`` evicts.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


class OutOfPages(RuntimeError):
    """Not enough free or evictable pages; nothing was allocated."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"KV pool out of pages: need {needed}, {available} free or evictable")
        self.needed = needed
        self.available = available


@dataclass(slots=True)
class BlockPool:
    num_pages: int
    refcounts: list[int] = field(init=False)
    # Never-cached (or forgotten) free pages; popped from the left.
    free_list: deque[int] = field(init=False)
    # Cached pages with refcount 0, least recently released first.
    lru: OrderedDict[int, None] = field(init=False)
    hash_to_page: dict[bytes, int] = field(init=False, default_factory=dict)
    page_to_hash: dict[int, bytes] = field(init=False, default_factory=dict)
    evictions: int = 0

    def __post_init__(self) -> None:
        self.refcounts = [0] * self.num_pages
        self.free_list = deque(range(self.num_pages))
        self.lru = OrderedDict()

    # ------------------------------------------------------------ queries
    @property
    def num_available(self) -> int:
        """Pages ``allocate`` can hand out: free plus evictable cached pages."""
        return len(self.free_list) + len(self.lru)

    @property
    def num_in_use(self) -> int:
        return self.num_pages - self.num_available

    def lookup(self, page_hash: bytes) -> int | None:
        return self.hash_to_page.get(page_hash)

    # ------------------------------------------------------------ changes
    def allocate(self, n: int) -> list[int]:
        """``n`` pages with refcount 1: free pages first, then evict LRU cached pages."""
        if n > self.num_available:
            raise OutOfPages(n, self.num_available)
        pages: list[int] = []
        for _ in range(n):
            if self.free_list:
                page = self.free_list.popleft()
            else:
                page, _ = self.lru.popitem(last=False)
                del self.hash_to_page[self.page_to_hash.pop(page)]
                self.evictions += 1
            assert self.refcounts[page] == 0
            self.refcounts[page] = 1
            pages.append(page)
        return pages

    def share(self, page: int) -> None:
        """Take one more reference to a cached or in-use page (a prefix hit)."""
        assert page in self.page_to_hash or self.refcounts[page] > 0, "sharing a free page"
        if self.refcounts[page] == 0:
            del self.lru[page]
        self.refcounts[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference per page; the first listed becomes least recently used.

        Callers release a block table in reverse, so a chain's tail is evicted
        before its head (a head evicted first would strand the tail).
        """
        for page in pages:
            assert self.refcounts[page] > 0, f"page {page} released more often than taken"
            self.refcounts[page] -= 1
            if self.refcounts[page] == 0:
                if page in self.page_to_hash:
                    self.lru[page] = None
                else:
                    self.free_list.append(page)

    def register(self, page: int, page_hash: bytes) -> bool:
        """Make an in-use page findable under ``page_hash``.

        Returns False when another page already holds that hash (two requests
        computed the same prefix): the first stays the cached copy and this page
        is freed normally when released.
        """
        assert self.refcounts[page] > 0, "only a page in use can be registered"
        if page_hash in self.hash_to_page or page in self.page_to_hash:
            return self.hash_to_page.get(page_hash) == page
        self.hash_to_page[page_hash] = page
        self.page_to_hash[page] = page_hash
        return True
