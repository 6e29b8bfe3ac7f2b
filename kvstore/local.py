"""One process's KV: the bookkeeping (``KVCacheManager``) and the bytes (``DevicePool``).

Built together because they share a page count and an SSD tier, then handed
to different owners: the manager to the scheduler and ``LLMEngine``, the pool
to the model runner (docs/design/kvstore.md, "Bookkeeping and bytes").
"""

from __future__ import annotations

import os
from typing import NamedTuple

from kvstore.device.device_pool import DevicePool, require_pages
from kvstore.device.layout import KVLayout
from kvstore.manager import KVCacheManager
from kvstore.ssd.persistent import PersistentStore


class LocalKV(NamedTuple):
    """``manager, pages = open_local_kv(...)``; as a context, closes the manager."""

    manager: KVCacheManager
    pages: DevicePool

    def __enter__(self) -> LocalKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.manager.close()


def open_local_kv(
    layout: KVLayout,
    cache_bytes: int,
    device: str = "cpu",
    kv_dir: str | os.PathLike[str] | None = None,
    kv_dir_bytes: int | None = None,
    write_workers: int = 2,
    read_workers: int = 4,
    max_pending_writes: int = 1024,
) -> LocalKV:
    """A pool of ``cache_bytes // page_bytes`` pages on ``device``, with an SSD tier in
    ``kv_dir`` if given (the manager closes it)."""
    num_pages = require_pages(layout, cache_bytes)
    store = (
        PersistentStore(
            kv_dir, layout, kv_dir_bytes, write_workers, read_workers, max_pending_writes
        )
        if kv_dir is not None
        else None
    )
    pages = DevicePool(layout, num_pages, device, store)
    return LocalKV(KVCacheManager(layout, num_pages, store=store, pages=pages), pages)
