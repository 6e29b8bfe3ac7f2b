"""Paged global KV: write new entries as FP4 records, read entries back as floats.

Pages are the KV store's ``uint8`` views of one kv source (kvstore/device/device_pool.py
``SourcePages``): ``main_data [P, E, 256]``, ``main_scales [P, E, 32]``,
``index_data [P, E, 64]``, ``index_scales [P, E, 4]`` (E = entries per page).
Entry ``j`` of a sequence lives at page ``block_table[j // E]``, slot ``j % E``.
Records are the ``kernels.kv_formats`` ones: the 288-byte FP4 main record and
the 68-byte MXFP4 index key, split into their data and scale bytes.

Each public op runs the Triton kernel or the PyTorch reference (``kernels.dispatch``).

The ``--kv-dtype bf16`` ablation stores unquantised records: 1024 data bytes
(512 bf16 values) and 256 (128 bf16 values), with no scale bytes. A source
whose scale views are empty is read and written that way, by the references
only (the Triton kernels decode FP4).
"""

from __future__ import annotations

import torch

from kernels import cpu_index_keys
from kernels.dispatch import use_triton
from kernels.kv_formats import (
    INDEX_KEY,
    MAIN_KV,
    dequantize_index_key_parts,
    dequantize_main_kv_parts,
    quantize_index_key,
    quantize_main_kv,
)


def locate(
    block_table: torch.Tensor, entry_idx: torch.Tensor, entries_per_page: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids, slots) of entries ``entry_idx`` (negative entries map to entry 0)."""
    j = entry_idx.clamp(min=0)
    return block_table[torch.div(j, entries_per_page, rounding_mode="floor")], j % entries_per_page


def is_raw_bf16(scales: torch.Tensor) -> bool:
    """True for the bf16 ablation's pages: records without scale bytes."""
    return scales.shape[-1] == 0


def read_main(
    main_data: torch.Tensor, main_scales: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """float32 ``[..., 512]`` values of the main records at (pages, slots)."""
    if is_raw_bf16(main_scales):
        return main_data[pages, slots].view(torch.bfloat16).float()
    return dequantize_main_kv_parts(main_data[pages, slots], main_scales[pages, slots])


def read_index(
    index_data: torch.Tensor, index_scales: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """float32 ``[..., 128]`` values of the index keys at (pages, slots)."""
    if is_raw_bf16(index_scales):
        return index_data[pages, slots].view(torch.bfloat16).float()
    return dequantize_index_key_parts(index_data[pages, slots], index_scales[pages, slots])


def read_index_pages(
    index_data: torch.Tensor, index_scales: torch.Tensor, pages: torch.Tensor
) -> torch.Tensor:
    """float32 ``[..., E, 128]``: every index key of the pages ``pages [...]``.

    Whole pages are gathered (one row copy per page, not one per entry) and
    decoded from the page views directly.
    """
    if not is_raw_bf16(index_scales) and cpu_index_keys.usable(index_data, index_scales, pages):
        return cpu_index_keys.read_index_pages(index_data, index_scales, pages)  # one C pass
    flat = pages.reshape(-1)
    data = index_data.index_select(0, flat).view(*pages.shape, *index_data.shape[1:])
    if is_raw_bf16(index_scales):
        return data.view(torch.bfloat16).float()
    scales = index_scales.index_select(0, flat).view(*pages.shape, *index_scales.shape[1:])
    return dequantize_index_key_parts(data, scales)


# ----------------------------------------------------------------- store


def store_kv_entries(
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    latents: torch.Tensor,
    keys: torch.Tensor,
) -> None:
    """Quantise N new entries and write them into their pages in place.

    ``latents [N, 512]`` (RoPE'd) become FP4 main records, ``keys [N, 128]``
    MXFP4 index keys; entry n goes to page ``page_ids[n]``, slot ``slots[n]``.
    The (page, slot) pairs must be distinct.
    """
    if latents.shape[0] == 0:
        return
    if use_triton(main_data, latents, op="store_kv") and not is_raw_bf16(main_scales):
        from kernels.triton.store_kv import store_kv_entries_triton

        store_kv_entries_triton(
            main_data, main_scales, index_data, index_scales, page_ids, slots, latents, keys
        )
        return
    store_kv_entries_reference(
        main_data, main_scales, index_data, index_scales, page_ids, slots, latents, keys
    )


def store_kv_entries_reference(
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    latents: torch.Tensor,
    keys: torch.Tensor,
) -> None:
    if is_raw_bf16(main_scales):
        main_data[page_ids, slots] = latents.to(torch.bfloat16).view(torch.uint8)
        index_data[page_ids, slots] = keys.to(torch.bfloat16).view(torch.uint8)
        return
    main = quantize_main_kv(latents)
    index = quantize_index_key(keys)
    # Indexed assignment on a view writes through to the pool's storage.
    main_data[page_ids, slots] = main[:, : MAIN_KV.data_bytes]
    main_scales[page_ids, slots] = main[:, MAIN_KV.data_bytes :]
    index_data[page_ids, slots] = index[:, : INDEX_KEY.data_bytes]
    index_scales[page_ids, slots] = index[:, INDEX_KEY.data_bytes :]


# ----------------------------------------------------------------- gather


def gather_main_kv(
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    block_table: torch.Tensor,
    entry_idx: torch.Tensor,
) -> torch.Tensor:
    """float32 ``[..., 512]``: dequantised main records of ``entry_idx [...]``; -1 gives zeros."""
    if use_triton(main_data, entry_idx, op="gather_main_kv") and not is_raw_bf16(main_scales):
        from kernels.triton.gather_kv import gather_main_kv_triton

        return gather_main_kv_triton(main_data, main_scales, block_table, entry_idx)
    return gather_main_kv_reference(main_data, main_scales, block_table, entry_idx)


def gather_main_kv_reference(
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    block_table: torch.Tensor,
    entry_idx: torch.Tensor,
) -> torch.Tensor:
    pages, slots = locate(block_table, entry_idx, main_data.shape[1])
    out = read_main(main_data, main_scales, pages, slots)
    return out.masked_fill((entry_idx < 0)[..., None], 0.0)


def gather_index_keys(
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    block_table: torch.Tensor,
    n_entries: int,
) -> torch.Tensor:
    """float32 ``[n_entries, 128]``: the dequantised index keys of entries ``0 .. n_entries-1``."""
    if use_triton(index_data, block_table, op="gather_index_keys") and not is_raw_bf16(
        index_scales
    ):
        from kernels.triton.gather_kv import gather_index_keys_triton

        return gather_index_keys_triton(index_data, index_scales, block_table, n_entries)
    return gather_index_keys_reference(index_data, index_scales, block_table, n_entries)


def gather_index_keys_reference(
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    block_table: torch.Tensor,
    n_entries: int,
) -> torch.Tensor:
    entries = torch.arange(n_entries, device=block_table.device)
    pages, slots = locate(block_table, entries, index_data.shape[1])
    return read_index(index_data, index_scales, pages, slots)
