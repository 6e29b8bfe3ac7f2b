"""Compress-quantise-store: N latents and index keys -> FP4 / MXFP4 records in their page slots.

One program per entry. Values are loaded as (even, odd) element pairs so each
pair becomes one packed byte without a shuffle. Bit-identical to
``kernels.kv_formats.quantize_main_kv`` / ``quantize_index_key``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.formats import (
    e2m1_code,
    e4m3_byte_positive,
    e4m3_round_positive,
    mxfp4_exponent,
    pow2,
)


@triton.jit
def _store_kv_kernel(
    lat_ptr,
    lat_stride,
    key_ptr,
    key_stride,
    page_ptr,
    slot_ptr,
    md_ptr,
    md_sp,
    md_se,
    ms_ptr,
    ms_sp,
    ms_se,
    id_ptr,
    id_sp,
    id_se,
    is_ptr,
    is_sp,
    is_se,
):
    n = tl.program_id(0).to(tl.int64)
    page = tl.load(page_ptr + n).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)

    # Main record: 32 tiles of 16 values = 32 x 8 bytes, one E4M3 scale per tile.
    tile = tl.arange(0, 32)[:, None]
    pair = tl.arange(0, 8)[None, :]
    elem = lat_ptr + n * lat_stride + tile * 16 + pair * 2
    lo = tl.load(elem).to(tl.float32)
    hi = tl.load(elem + 1).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(lo), 1), tl.max(tl.abs(hi), 1))
    nan = tl.max(((lo != lo) | (hi != hi)).to(tl.int32), 1) > 0
    scale = tl.minimum(tl.maximum(tl.math.div_rn(amax, 6.0), 0.001953125), 448.0)
    scale = e4m3_round_positive(scale)
    codes = e2m1_code(tl.math.div_rn(lo, scale[:, None]))
    codes |= e2m1_code(tl.math.div_rn(hi, scale[:, None])) << 4
    codes = tl.where(nan[:, None], 0, codes)
    tl.store(md_ptr + page * md_sp + slot * md_se + tile * 8 + pair, codes.to(tl.uint8))
    scale_byte = tl.where(nan, 0x7F, e4m3_byte_positive(scale))
    tl.store(ms_ptr + page * ms_sp + slot * ms_se + tl.arange(0, 32), scale_byte.to(tl.uint8))

    # Index key: 4 blocks of 32 values = 4 x 16 bytes, one UE8M0 exponent per block.
    block = tl.arange(0, 4)[:, None]
    kpair = tl.arange(0, 16)[None, :]
    kelem = key_ptr + n * key_stride + block * 32 + kpair * 2
    klo = tl.load(kelem).to(tl.float32)
    khi = tl.load(kelem + 1).to(tl.float32)
    kamax = tl.maximum(tl.max(tl.abs(klo), 1), tl.max(tl.abs(khi), 1))
    knan = tl.max(((klo != klo) | (khi != khi)).to(tl.int32), 1) > 0
    e = mxfp4_exponent(kamax)
    inv = pow2(-e)[:, None]  # x / 2^e == x * 2^-e exactly
    kcodes = e2m1_code(klo * inv) | (e2m1_code(khi * inv) << 4)
    kcodes = tl.where(knan[:, None], 0, kcodes)
    tl.store(id_ptr + page * id_sp + slot * id_se + block * 16 + kpair, kcodes.to(tl.uint8))
    kscale = tl.where(knan, 0xFF, e + 127)
    tl.store(is_ptr + page * is_sp + slot * is_se + tl.arange(0, 4), kscale.to(tl.uint8))


def store_kv_entries_triton(
    main_data: torch.Tensor,
    main_scales: torch.Tensor,
    index_data: torch.Tensor,
    index_scales: torch.Tensor,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    latents: torch.Tensor,
    keys: torch.Tensor,
) -> None:
    """Triton ``store_kv_entries`` (same contract)."""
    n = latents.shape[0]
    assert latents.shape == (n, 512) and keys.shape == (n, 128), (latents.shape, keys.shape)
    assert page_ids.shape == (n,) and slots.shape == (n,)
    for view, width in ((main_data, 256), (main_scales, 32), (index_data, 64), (index_scales, 4)):
        assert view.dtype == torch.uint8 and view.shape[2] == width and view.stride(2) == 1
    if n == 0:
        return
    latents = latents.contiguous()
    keys = keys.contiguous()
    _store_kv_kernel[(n,)](
        latents,
        latents.stride(0),
        keys,
        keys.stride(0),
        page_ids.contiguous(),
        slots.contiguous(),
        main_data,
        main_data.stride(0),
        main_data.stride(1),
        main_scales,
        main_scales.stride(0),
        main_scales.stride(1),
        index_data,
        index_data.stride(0),
        index_data.stride(1),
        index_scales,
        index_scales.stride(0),
        index_scales.stride(1),
        enable_fp_fusion=False,  # no contraction: bit-identical to the PyTorch quantiser
    )
