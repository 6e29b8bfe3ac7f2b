"""The device tier's memory: one ``uint8[num_pages, page_bytes]`` tensor.

Row ``p`` is page ``p`` of every kv source, so a page moves to or from the
SSD tier as one contiguous copy. Each source sees strided views of its own
byte range (main page, index page); kernels read and write through them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.device.layout import KVLayout
from kvstore.device.page_format import record_views


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
    """Owns the page tensor and hands out per-source views."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str = "cpu") -> None:
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        # Zeroed so a page never exposes a previous process's or request's bytes.
        self.pages = torch.zeros(num_pages, layout.page_bytes, dtype=torch.uint8, device=device)
        self._sources = {s.layer_id: self._views(s.layer_id) for s in layout.sources}

    @property
    def nbytes(self) -> int:
        return self.pages.numel() * self.pages.element_size()

    def source(self, layer_id: int) -> SourcePages:
        return self._sources[layer_id]

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
