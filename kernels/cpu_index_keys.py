"""Paged MXFP4 index keys decoded in one C call on CPU (``kernels.cpu_native``).

The indexer reads every visible index key per decode step; the eager decode
(``kernels.kv_formats.dequantize_index_key_parts``) gathers the pages, widens
every byte to an int32 table index and gathers from the (scale, byte) product
table: four passes over the keys. The C loop reads the page bytes in place and
copies the same table entries into the output: one pass, bit copies of the
same table, so equal to the eager decode by construction.
"""

from __future__ import annotations

import torch

from kernels import cpu_native
from kernels.kv_formats import index_key_table


def usable(index_data: torch.Tensor, index_scales: torch.Tensor, pages: torch.Tensor) -> bool:
    """CPU uint8 page views ``[P, E, 64]`` / ``[P, E, 4]`` with packed entries, long page ids."""
    return (
        index_data.device.type == "cpu"
        and index_data.dtype == torch.uint8
        and index_scales.dtype == torch.uint8
        and index_data.dim() == 3
        and index_data.shape[2] == 64
        and index_scales.shape[2] == 4
        and index_data.stride()[1:] == (64, 1)
        and index_scales.stride()[1:] == (4, 1)
        and pages.dtype == torch.int64
        and cpu_native.available()
    )


def read_index_pages(
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    pages: torch.Tensor,
    scratch: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """float32 ``[*pages.shape, E, 128]``: ``kvstore`` pages' index keys (``usable`` first).

    ``scratch``: a float32 buffer of at least that many values to decode into (a view
    of it is returned), so a caller scoring block by block reuses one cache-resident
    buffer instead of faulting in fresh pages for every block. ``check=False``: the
    caller has already checked every page id is in range (the C loop does not).
    """
    lib = cpu_native.library()
    assert lib is not None
    flat = pages.reshape(-1).contiguous()
    n_pages = flat.numel()
    E = index_data.shape[1]
    if check and n_pages and (int(flat.min()) < 0 or int(flat.max()) >= index_data.shape[0]):
        raise IndexError(f"page id out of range [0, {index_data.shape[0]})")
    size = n_pages * E * 128
    if scratch is not None:
        assert scratch.dtype == torch.float32 and scratch.is_contiguous()
        assert scratch.numel() >= size, "scratch too small"
        out = scratch.view(-1)[:size].view(n_pages, E, 128)
    else:
        out = torch.empty(n_pages, E, 128, dtype=torch.float32)
    table = index_key_table(index_data.device)
    lib.fs_index_keys_f32(
        index_data.data_ptr(),
        index_data.stride(0),
        index_scales.data_ptr(),
        index_scales.stride(0),
        flat.data_ptr(),
        n_pages,
        E,
        table.data_ptr(),
        out.data_ptr(),
    )
    return out.view(*pages.shape, E, 128)
