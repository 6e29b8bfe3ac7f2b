"""A page's in-memory layout: all records' data, then all their scales.

See docs/design/architecture.md §1.10.

Records arrive from the quantisers as ``[n, record_bytes]`` rows (data bytes
then scale bytes). In a page the data parts of all ``n`` records come first,
contiguous, then the scale parts, so a kernel reads the FP4 codes of a tile of
entries with one contiguous load. These helpers are the only place that
layout is spelled out.
"""

from __future__ import annotations

import torch


def pack_records(records: torch.Tensor, data_bytes: int) -> torch.Tensor:
    """``uint8[n, rec]`` records -> ``uint8[n * rec]`` page bytes (data block, scale block)."""
    assert records.dtype == torch.uint8 and records.dim() == 2, "records must be uint8[n, rec]"
    assert 0 < data_bytes <= records.shape[1]
    return torch.cat([records[:, :data_bytes].reshape(-1), records[:, data_bytes:].reshape(-1)])


def unpack_page(page: torch.Tensor, record_bytes: int, data_bytes: int) -> torch.Tensor:
    """``uint8[n * rec]`` page bytes -> ``uint8[n, rec]`` records (inverse of ``pack_records``)."""
    assert page.dtype == torch.uint8 and page.dim() == 1 and page.numel() % record_bytes == 0
    data, scales = record_views(page.unsqueeze(0), record_bytes, data_bytes)
    return torch.cat([data[0], scales[0]], dim=1)


def record_views(
    pages: torch.Tensor, record_bytes: int, data_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``data[P, n, data_bytes]`` and ``scales[P, n, record_bytes - data_bytes]``.

    ``pages`` is ``uint8[P, n * record_bytes]`` (rows may be strided, as in the
    device pool); writing through the views writes the pages in place.
    """
    assert pages.dim() == 2 and pages.shape[1] % record_bytes == 0
    n = pages.shape[1] // record_bytes
    data = pages[:, : n * data_bytes].unflatten(1, (n, data_bytes))
    scales = pages[:, n * data_bytes :].unflatten(1, (n, record_bytes - data_bytes))
    return data, scales
