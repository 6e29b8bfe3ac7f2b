"""The device tier's memory: one ``uint8[num_pages, page_bytes]`` tensor.

Row ``p`` is page ``p`` of every kv source, so a page moves to or from the
SSD tier as one contiguous copy. Each source sees strided views of its own
byte range (main page, index page); kernels read and write through them.

The pool belongs to whoever runs the model (the runner in one process, each
worker under parallel serving), never to the bookkeeping: ``KVCacheManager``
(``kvstore/manager.py``) names pages, and a pool with an SSD tier is its
``PageBytes``, copying page files in (``load``) and committed pages out
(``write_behind``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.device.layout import KVLayout
from kvstore.device.page_format import record_views
from kvstore.ssd.persistent import PersistentStore


@dataclass(frozen=True, slots=True)
class SourcePages:
    """Views of one kv source's pages; all share storage with the pool.

    ``main``: ``uint8[P, E * main_record_bytes]``, ``index``: ``uint8[P, E * index_record_bytes]``
    (E = entries per page). The ``*_data`` / ``*_scales`` views split each page
    into ``[P, E, data_bytes]`` and ``[P, E, scale_bytes]``.
    """

    layer_id: int
    compress_ratio: int
    entries_per_page: int
    main: torch.Tensor
    index: torch.Tensor
    main_data: torch.Tensor
    main_scales: torch.Tensor
    index_data: torch.Tensor
    index_scales: torch.Tensor


def pages_for_bytes(layout: KVLayout, cache_bytes: int) -> int:
    """Whole pages that fit in ``cache_bytes`` (the ``--kv-cache-bytes`` budget)."""
    return max(0, cache_bytes // layout.page_bytes)


def require_pages(layout: KVLayout, cache_bytes: int) -> int:
    """``pages_for_bytes``, refusing a budget that holds no page."""
    num_pages = pages_for_bytes(layout, cache_bytes)
    if num_pages < 1:
        raise ValueError(
            f"kv cache of {cache_bytes} bytes holds no page of {layout.page_bytes} bytes"
        )
    return num_pages


def free_device_bytes(device: str) -> int:
    """Free memory of ``device`` in bytes (for a ``fraction of free memory`` budget)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    # CPU mode: available RAM as the kernel reports it.
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


class DevicePool:
    """Owns the page tensor, hands out per-source views, moves whole pages in and out.

    ``store``: the SSD tier its pages are restored from and written behind to
    (``PageBytes`` for the pool's ``KVCacheManager``); None without one.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        device: str = "cpu",
        store: PersistentStore | None = None,
    ) -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.store = store
        # Zeroed so a page never exposes a previous process's or request's bytes.
        self.pages = torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8, device=device)
        self._sources = {s.layer_id: self._views(s.layer_id) for s in layout.sources}

    @property
    def nbytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()

    def source(self, layer_id: int) -> SourcePages:
        return self._sources[layer_id]

    # ------------------------------------------------------------ whole pages
    def copy_in(self, rows: Sequence[tuple[int, bytes | bytearray | memoryview]]) -> None:
        """Write whole pages ``(page, bytes)`` (restored from SSD, or shipped by the core)."""
        if not rows:
            return
        # frombuffer wants a writable buffer: immutable bytes are copied once.
        data = torch.stack(
            [
                torch.frombuffer(bytearray(b) if isinstance(b, bytes) else b, dtype=torch.uint8)
                for _, b in rows
            ]
        )
        ids = torch.tensor([page for page, _ in rows], device=self.device)
        self.pages.index_copy_(0, ids, data.to(self.device))

    def copy_out(self, pages: list[int]) -> list[tuple[int, bytes]]:
        """Whole pages as host bytes ``(page, bytes)`` (for the core's write-behind)."""
        return [(p, self.pages[p].cpu().numpy().tobytes()) for p in pages]

    # ------------------------------------------------------------ PageBytes
    def load(self, pages: list[tuple[bytes, int]]) -> list[bool]:
        """Read the files of ``(page hash, device page)`` from the SSD tier into the pool."""
        assert self.store is not None, "no SSD tier to load from"
        payloads = self.store.get_many([h for h, _ in pages])
        self.copy_in(
            [(p, data) for (_, p), data in zip(pages, payloads, strict=True) if data is not None]
        )
        return [data is not None for data in payloads]

    def write_behind(self, chain: list[tuple[bytes, int]]) -> None:
        """Queue committed pages for the SSD tier (it snapshots the rows at once)."""
        assert self.store is not None, "no SSD tier to write to"
        self.store.put_chain([(h, self.pages[p]) for h, p in chain])

    def _views(self, layer_id: int) -> SourcePages:
        s = self.layout.source(layer_id)
        pt = self.layout.page_tokens
        main_off, index_off = self.layout.offsets(layer_id)
        main = self.pages[:, main_off : main_off + s.main_page_bytes(pt)]
        index = self.pages[:, index_off : index_off + s.index_page_bytes(pt)]
        main_data, main_scales = record_views(main, s.main_record_bytes, s.main_data_bytes)
        index_data, index_scales = record_views(index, s.index_record_bytes, s.index_data_bytes)
        return SourcePages(
            layer_id=layer_id,
            compress_ratio=s.compress_ratio,
            entries_per_page=s.entries_per_page(pt),
            main=main,
            index=index,
            main_data=main_data,
            main_scales=main_scales,
            index_data=index_data,
            index_scales=index_scales,
        )
