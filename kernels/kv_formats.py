"""KV cache records (docs/design/architecture.md §1.10): float vectors <-> fixed-size byte records.

Each record is its data bytes followed by its scale bytes. Every function takes
``[..., dims]`` (any leading shape, including an empty batch; bf16, fp16 or fp32;
any device) and returns ``uint8 [..., record_bytes]``, or the reverse. The
``fake_quant_*`` round trips are what the dense reference applies to the values
it would have stored. A NaN anywhere in a tile poisons the whole tile: its
scale byte is the format's NaN and its value bytes are zero, so all of the
tile's values decode to NaN. Byte layouts and decisions: docs/design/formats.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

import torch

from kernels.quant import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_NAN_BYTE,
    E8M0_NAN_BYTE,
    e2m1_decode_packed,
    e2m1_encode,
    e4m3_from_bytes,
    e4m3_round,
    e4m3_to_bytes,
    e8m0_decode,
    e8m0_encode,
    pack_nibbles,
    pow2,
    pow2_exponent,
)


@dataclass(frozen=True, slots=True)
class KVRecordLayout:
    """Sizes of one record kind: ``dims`` values, one scale per ``tile`` values."""

    name: str
    dims: int
    tile: int
    data_bytes: int
    scale_bytes: int

    @property
    def record_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes


# The record sizes, defined here once; kvstore's page layout and the accounting of
# ``flashserve inspect`` import them.
MAIN_KV = KVRecordLayout("main_kv", dims=512, tile=16, data_bytes=256, scale_bytes=32)
INDEX_KEY = KVRecordLayout("index_key", dims=128, tile=32, data_bytes=64, scale_bytes=4)
INDEX_KEY_FP8 = KVRecordLayout("index_key_fp8", dims=128, tile=128, data_bytes=128, scale_bytes=4)
SWA = KVRecordLayout("swa", dims=512, tile=32, data_bytes=512, scale_bytes=16)
# The ``--kv-dtype bf16`` ablation stores global KV unquantised: 2 B per value, no scales.
MAIN_KV_BF16 = KVRecordLayout("main_kv_bf16", dims=512, tile=512, data_bytes=1024, scale_bytes=0)
INDEX_KEY_BF16 = KVRecordLayout("index_key_bf16", dims=128, tile=128, data_bytes=256, scale_bytes=0)

MAIN_KV_BYTES = MAIN_KV.record_bytes  # 288: 256 B of E2M1 pairs + 32 E4M3 scales (per 16)
INDEX_KEY_BYTES = INDEX_KEY.record_bytes  # 68: 64 B of E2M1 pairs + 4 UE8M0 scales (per 32)
INDEX_KEY_FP8_BYTES = INDEX_KEY_FP8.record_bytes  # 132: 128 E4M3 values + one fp32 scale
SWA_BYTES = SWA.record_bytes  # 528: 512 E4M3 values + 16 UE8M0 scales (per 32)

# Global KV record pair (main record, index key) of each ``kv_dtype``.
GLOBAL_KV_RECORDS: dict[str, tuple[KVRecordLayout, KVRecordLayout]] = {
    "fp4": (MAIN_KV, INDEX_KEY),
    "bf16": (MAIN_KV_BF16, INDEX_KEY_BF16),
}


def global_kv_records(kv_dtype: str) -> tuple[KVRecordLayout, KVRecordLayout]:
    """(main record, index key) layouts of ``kv_dtype``; a clear error for an unknown one."""
    if kv_dtype not in GLOBAL_KV_RECORDS:
        raise ValueError(
            f"unknown kv dtype {kv_dtype!r}; expected one of {sorted(GLOBAL_KV_RECORDS)}"
        )
    return GLOBAL_KV_RECORDS[kv_dtype]


def global_kv_bytes_per_token(source_ratios: Iterable[int], kv_dtype: str = "fp4") -> Fraction:
    """Bytes of global KV per input token: each kv source stores a main record and an
    index key once per ``ratio`` tokens (official fp4: 3 x 356 / 2 + 356 = 890)."""
    main, index = global_kv_records(kv_dtype)
    return sum(
        (Fraction(main.record_bytes + index.record_bytes, r) for r in source_ratios), Fraction(0)
    )


def swa_bytes_per_request(sliding_window: int, swa_layers: int) -> int:
    """A full window of SWA records in every layer: bounded per request, never paged."""
    return sliding_window * SWA.record_bytes * swa_layers


MAIN_KV_MIN_SCALE = 2.0**-9  # smallest E4M3 subnormal: the scale never rounds to zero
INDEX_KEY_AMAX_FLOOR = E2M1_MAX * 2.0**-126  # so e >= -126
SWA_AMAX_FLOOR = 1e-4

_F32_NAN_BITS = 0x7FC00000


def _tiles(x: torch.Tensor, layout: KVRecordLayout) -> torch.Tensor:
    """``x [..., dims]`` as float32 ``[M, dims // tile, tile]``."""
    if x.shape[-1] != layout.dims:
        raise ValueError(f"{layout.name}: expected last dim {layout.dims}, got {tuple(x.shape)}")
    return x.float().reshape(-1, layout.dims // layout.tile, layout.tile)


def _split(rec: torch.Tensor, layout: KVRecordLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(data [M, data_bytes], scales [M, scale_bytes]) of ``rec [..., record_bytes]``."""
    if rec.dtype != torch.uint8 or rec.shape[-1] != layout.record_bytes:
        raise ValueError(
            f"{layout.name}: expected uint8 [..., {layout.record_bytes}], "
            f"got {rec.dtype} {tuple(rec.shape)}"
        )
    flat = rec.reshape(-1, layout.record_bytes)
    return flat[:, : layout.data_bytes], flat[:, layout.data_bytes :]


def _join(
    data: torch.Tensor, scales: torch.Tensor, lead: torch.Size, layout: KVRecordLayout
) -> torch.Tensor:
    data = data.reshape(-1, layout.data_bytes)
    rec = torch.cat([data, scales.reshape(-1, layout.scale_bytes)], 1)
    return rec.reshape(*lead, layout.record_bytes)


def _fill(t: torch.Tensor, mask: torch.Tensor, byte: int) -> torch.Tensor:
    return torch.where(mask, torch.full_like(t, byte), t)


# ----------------------------------------------------------------- main global KV, 288 B


def quantize_main_kv(x: torch.Tensor) -> torch.Tensor:
    """RoPE'd latents ``[..., 512]`` -> 288-byte records.

    Per tile of 16: ``scale = e4m3(clamp(amax / 6, 2^-9, 448))``; values are
    ``e2m1(x / scale)`` with the rounded scale, so decoding multiplies by
    exactly the scale that was divided by.
    """
    t = _tiles(x, MAIN_KV)
    nan = torch.isnan(t).any(-1)
    amax = t.abs().amax(-1)
    scale = e4m3_round(torch.clamp(amax / E2M1_MAX, MAIN_KV_MIN_SCALE, E4M3_MAX))
    codes = _fill(e2m1_encode(t / scale[..., None]), nan[..., None], 0)
    scale_bytes = _fill(e4m3_to_bytes(scale), nan, E4M3_NAN_BYTE)
    return _join(pack_nibbles(codes.reshape(-1, 512)), scale_bytes, x.shape[:-1], MAIN_KV)


def dequantize_main_kv(rec: torch.Tensor) -> torch.Tensor:
    """288-byte records ``[..., 288]`` -> float32 ``[..., 512]``."""
    data, scales = _split(rec, MAIN_KV)
    return dequantize_main_kv_parts(data, scales).reshape(*rec.shape[:-1], 512)


def dequantize_main_kv_parts(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``dequantize_main_kv`` of records kept as separate data ``[..., 256]`` and scale
    ``[..., 32]`` bytes (the page views): no joined record is built."""
    values = e2m1_decode_packed(data).reshape(-1, 32, 16)
    out = values * e4m3_from_bytes(scales.reshape(-1, 32))[..., None]
    return out.reshape(*data.shape[:-1], 512)


def fake_quant_main_kv(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the 288-byte record and back, in ``x``'s dtype."""
    return dequantize_main_kv(quantize_main_kv(x)).to(x.dtype)


# ----------------------------------------------------------------- index key, MXFP4, 68 B


def quantize_index_key(x: torch.Tensor) -> torch.Tensor:
    """Index keys ``[..., 128]`` -> 68-byte MXFP4 records.

    Per block of 32: ``e = ceil(log2(max(amax, 6 * 2^-126) / 6))``, values
    ``e2m1(x / 2^e)``, scale byte ``e + 127``.
    """
    t = _tiles(x, INDEX_KEY)
    nan = torch.isnan(t).any(-1)
    e = pow2_exponent(t.abs().amax(-1), E2M1_MAX, INDEX_KEY_AMAX_FLOOR)
    codes = _fill(e2m1_encode(t / pow2(e)[..., None]), nan[..., None], 0)
    scale_bytes = _fill(e8m0_encode(e), nan, E8M0_NAN_BYTE)
    return _join(pack_nibbles(codes.reshape(-1, 128)), scale_bytes, x.shape[:-1], INDEX_KEY)


def dequantize_index_key(rec: torch.Tensor) -> torch.Tensor:
    """68-byte records ``[..., 68]`` -> float32 ``[..., 128]``."""
    data, scales = _split(rec, INDEX_KEY)
    return dequantize_index_key_parts(data, scales).reshape(*rec.shape[:-1], 128)


def dequantize_index_key_parts(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``dequantize_index_key`` of keys kept as separate data ``[..., 64]`` and scale
    ``[..., 4]`` bytes (the page views): no joined record is built."""
    # One gather per byte from a 256 x 256 table of (scale byte, data byte) -> both
    # values already multiplied by the scale: the products the two-step decode
    # forms, computed once, so decoding is one pass (the indexer reads every
    # visible key per step).
    table = index_key_table(data.device)
    n = data.reshape(-1, 64).shape[0]
    at = (scales.reshape(n, 4, 1).to(torch.int32) << 8) | data.reshape(n, 4, 16).to(torch.int32)
    out = torch.index_select(table, 0, at.view(-1)).view(torch.float32)
    return out.view(*data.shape[:-1], 128)


def index_key_table(device: torch.device) -> torch.Tensor:
    """int64 ``[256 * 256]``: entry ``scale_byte << 8 | data_byte`` holds that byte's two
    float32 values times the scale (``kernels.cpu_index_keys`` copies from it too)."""
    table = _INDEX_KEY_TABLES.get(device)
    if table is None:
        every = torch.arange(256, dtype=torch.uint8, device=device)
        pairs = e2m1_decode_packed(every[:, None])  # [256, 2]
        products = pairs[None, :, :] * e8m0_decode(every)[:, None, None]  # [scale, byte, 2]
        table = products.contiguous().view(torch.int64).view(-1)
        _INDEX_KEY_TABLES[device] = table
    return table


_INDEX_KEY_TABLES: dict[torch.device, torch.Tensor] = {}


def fake_quant_index_key(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the 68-byte record and back, in ``x``'s dtype."""
    return dequantize_index_key(quantize_index_key(x)).to(x.dtype)


# ----------------------------------------------------------------- index key, FP8, 132 B


def quantize_index_key_fp8(x: torch.Tensor) -> torch.Tensor:
    """Index keys ``[..., 128]`` -> 132-byte records: 128 E4M3 values, fp32 scale.

    ``scale = amax / 448`` (fp32), 1.0 when that is zero; values ``e4m3(x / scale)``.
    The scale is capped at the largest finite fp32 so an inf saturates to
    ``448 * scale`` like any other overflow. The scale is written little-endian
    whatever the host's byte order.
    """
    t = _tiles(x, INDEX_KEY_FP8)[:, 0]
    nan = torch.isnan(t).any(-1)
    scale = (t.abs().amax(-1) / E4M3_MAX).clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    values = _fill(e4m3_to_bytes(t / scale[:, None]), nan[:, None], 0)
    bits = scale.view(torch.int32)
    bits = torch.where(nan, torch.full_like(bits, _F32_NAN_BITS), bits)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int32, device=x.device)
    scale_bytes = ((bits[:, None] >> shifts) & 0xFF).to(torch.uint8)
    return _join(values, scale_bytes, x.shape[:-1], INDEX_KEY_FP8)


def dequantize_index_key_fp8(rec: torch.Tensor) -> torch.Tensor:
    """132-byte records ``[..., 132]`` -> float32 ``[..., 128]``."""
    data, scales = _split(rec, INDEX_KEY_FP8)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=rec.device)
    bits = (scales.to(torch.int64) << shifts).sum(-1)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # as a signed word
    scale = bits.view(torch.float32)
    out = e4m3_from_bytes(data) * scale[:, None]
    return out.reshape(*rec.shape[:-1], 128)


def fake_quant_index_key_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the 132-byte record and back, in ``x``'s dtype."""
    return dequantize_index_key_fp8(quantize_index_key_fp8(x)).to(x.dtype)


# ----------------------------------------------------------------- SWA, MXFP8, 528 B


def quantize_swa(x: torch.Tensor) -> torch.Tensor:
    """SWA KV ``[..., 512]`` -> 528-byte MXFP8 records.

    Per tile of 32: ``e = ceil(log2(max(amax, 1e-4) / 448))``, values
    ``e4m3(x / 2^e)``, scale byte ``e + 127``.
    """
    t = _tiles(x, SWA)
    nan = torch.isnan(t).any(-1)
    e = pow2_exponent(t.abs().amax(-1), E4M3_MAX, SWA_AMAX_FLOOR)
    values = _fill(e4m3_to_bytes(t / pow2(e)[..., None]), nan[..., None], 0)
    scale_bytes = _fill(e8m0_encode(e), nan, E8M0_NAN_BYTE)
    return _join(values, scale_bytes, x.shape[:-1], SWA)


def dequantize_swa(rec: torch.Tensor) -> torch.Tensor:
    """528-byte records ``[..., 528]`` -> float32 ``[..., 512]``."""
    data, scales = _split(rec, SWA)
    values = e4m3_from_bytes(data).reshape(-1, 16, 32)
    out = values * e8m0_decode(scales)[..., None]
    return out.reshape(*rec.shape[:-1], 512)


def fake_quant_swa(x: torch.Tensor) -> torch.Tensor:
    """``x`` through the 528-byte record and back, in ``x``'s dtype."""
    return dequantize_swa(quantize_swa(x)).to(x.dtype)
