"""Gather paged records back to floats: main FP4 records by entry index, index keys by prefix.

One program per entry. Byte i of a record holds elements 2i (low nibble) and
2i + 1 (high nibble); its scale is byte ``i // 8`` (main, 16 values per scale)
or ``i // 16`` (index key, 32 per scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.formats import e2m1_value, e4m3_value, e8m0_value


@triton.jit
def _gather_main_kernel(
    idx_ptr,
    bt_ptr,
    md_ptr,
    md_sp,
    md_se,
    ms_ptr,
    ms_sp,
    ms_se,
    out_ptr,
    E,
):
    n = tl.program_id(0).to(tl.int64)
    j = tl.load(idx_ptr + n)
    i = tl.arange(0, 256)
    # The validity test is made block-shaped: the interpreter rejects scalar masks.
    valid = (i * 0 + j) >= 0
    j = tl.maximum(j, 0)
    page = tl.load(bt_ptr + j // E).to(tl.int64)
    slot = j % E
    b = tl.load(md_ptr + page * md_sp + slot * md_se + i, mask=valid, other=0).to(tl.int32)
    s = tl.load(ms_ptr + page * ms_sp + slot * ms_se + i // 8, mask=valid, other=0).to(tl.int32)
    scale = e4m3_value(s)
    lo = tl.where(valid, e2m1_value(b & 15) * scale, 0.0)
    hi = tl.where(valid, e2m1_value(b >> 4) * scale, 0.0)
    tl.store(out_ptr + n * 512 + 2 * i, lo)
    tl.store(out_ptr + n * 512 + 2 * i + 1, hi)


@triton.jit
def _gather_index_kernel(bt_ptr, id_ptr, id_sp, id_se, is_ptr, is_sp, is_se, out_ptr, E):
    n = tl.program_id(0).to(tl.int64)
    page = tl.load(bt_ptr + n // E).to(tl.int64)
    slot = n % E
    i = tl.arange(0, 64)
    b = tl.load(id_ptr + page * id_sp + slot * id_se + i).to(tl.int32)
    scale = e8m0_value(tl.load(is_ptr + page * is_sp + slot * is_se + i // 16).to(tl.int32))
    tl.store(out_ptr + n * 128 + 2 * i, e2m1_value(b & 15) * scale)
    tl.store(out_ptr + n * 128 + 2 * i + 1, e2m1_value(b >> 4) * scale)


def _check_pages(data: torch.Tensor, scales: torch.Tensor, widths: tuple[int, int]) -> None:
    for view, width in zip((data, scales), widths, strict=True):
        assert view.dtype == torch.uint8 and view.shape[2] == width and view.stride(2) == 1


def gather_main_kv_triton(
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    block_table: torch.Tensor,
    entry_idx: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``gather_main_kv``; ``out`` (float32 ``[..., 512]``, contiguous) may be given."""
    _check_pages(main_data, main_scales, (256, 32))
    if out is None:
        out = torch.empty(*entry_idx.shape, 512, dtype=torch.float32, device=entry_idx.device)
    assert out.shape == (*entry_idx.shape, 512) and out.is_contiguous()
    n = entry_idx.numel()
    if block_table.numel() == 0:  # only -1 entries can be asked for; the kernel reads row 0
        block_table = torch.zeros(1, dtype=torch.int64, device=entry_idx.device)
    if n:
        _gather_main_kernel[(n,)](
            entry_idx.reshape(-1).contiguous(),
            block_table.contiguous(),
            main_data,
            main_data.stride(0),
            main_data.stride(1),
            main_scales,
            main_scales.stride(0),
            main_scales.stride(1),
            out,
            main_data.shape[1],
            enable_fp_fusion=False,
        )
    return out


def gather_index_keys_triton(
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    block_table: torch.Tensor,
    n_entries: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``gather_index_keys``; ``out`` (float32 ``[n_entries, 128]``) may be given."""
    _check_pages(index_data, index_scales, (64, 4))
    if out is None:
        out = torch.empty(n_entries, 128, dtype=torch.float32, device=block_table.device)
    assert out.shape == (n_entries, 128) and out.is_contiguous()
    if n_entries:
        _gather_index_kernel[(n_entries,)](
            block_table.contiguous(),
            index_data,
            index_data.stride(0),
            index_data.stride(1),
            index_scales,
            index_scales.stride(0),
            index_scales.stride(1),
            out,
            index_data.shape[1],
            enable_fp_fusion=False,
        )
    return out
