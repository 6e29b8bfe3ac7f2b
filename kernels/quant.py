"""Scalar number formats: E2M1 (FP4), E4M3 (FP8) and E8M0 (power-of-two scale bytes).

Pure PyTorch, elementwise over tensors of any shape, on any device. Every byte
format in ``kv_formats`` and ``weight_formats`` is built from these pieces.
Computation is float32; inputs of any float dtype are widened first.
"""

from __future__ import annotations

import itertools
import math

import torch

# Magnitudes of the eight non-negative E2M1 codes 0..7; bit 3 (0x8) is the sign.
E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_SIGN = 0x8

# Midpoints between neighbouring grid magnitudes, with the rounding direction on
# a tie: half-to-even means a tie goes to the code whose mantissa bit (code & 1)
# is 0, so a tie above an even code stays down (strict >) and a tie above an odd
# code goes up (>=). 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
# 3.5 -> 4, 5 -> 4.
_E2M1_STEPS: tuple[tuple[float, bool], ...] = tuple(
    ((lo + hi) / 2, code % 2 == 1)  # (midpoint, tie rounds up)
    for code, (lo, hi) in enumerate(itertools.pairwise(E2M1_GRID))
)

E4M3_MAX = 448.0
E4M3_NAN_BYTE = 0x7F  # S.1111.111: the only NaN encoding of float8_e4m3fn (plus its sign)

E8M0_BIAS = 127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
E8M0_NAN_BYTE = 0xFF


# ----------------------------------------------------------------- E2M1


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) of ``x``: round half to even, saturate at +-6.

    The sign bit follows ``signbit(x)``, so -0.0 and small negatives that round
    to zero give code 0x8. E2M1 has no NaN: a NaN maps to a zero code, and the
    record formats poison NaN tiles through their scale byte instead.
    """
    x = x.float()
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, tie_up in _E2M1_STEPS:
        code += (mag >= midpoint if tie_up else mag > midpoint).to(torch.uint8)
    sign = torch.signbit(x) & ~torch.isnan(x)
    return code | (sign.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Float32 values of E2M1 codes (uint8 0..15; higher bits are ignored)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=codes.device)
    c = codes.to(torch.uint8)
    mag = grid[(c & 0x7).long()]
    return torch.where((c & E2M1_SIGN) != 0, -mag, mag)


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def e2m1_decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Float32 values of packed E2M1 pairs: uint8/int8 ``[..., n]`` -> ``[..., 2n]``.

    Equal to ``e2m1_decode(unpack_nibbles(packed))`` but one table gather per
    byte (a 256 x 2 table of both nibbles' values), which is what makes the
    CPU reference of the FP4 KV path usable at long contexts.
    """
    table = _PAIR_TABLES.get(packed.device)
    if table is None:
        every_byte = torch.arange(256, dtype=torch.uint8, device=packed.device)
        pairs = e2m1_decode(unpack_nibbles(every_byte[:, None]))  # [256, 2] float32
        # Each byte's two float32 values as one 8-byte word: a 1-D index_select
        # moves whole words (bit copies, no arithmetic), several times faster on
        # CPU than advanced indexing of a [256, 2] table.
        table = pairs.contiguous().view(torch.int64).view(256)
        _PAIR_TABLES[packed.device] = table
    b = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    words = torch.index_select(table, 0, b.reshape(-1).to(torch.int32))
    return words.view(torch.float32).view(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes pairwise along the last dim: element 2i low nibble, 2i+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.uint8) & 0xF
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_nibbles``: uint8 [..., n] (uint8 or int8 bytes) -> codes [..., 2n]."""
    b = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed.to(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


# ----------------------------------------------------------------- E4M3


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """``float8_e4m3fn`` of ``x``: round half to even, saturate at +-448, NaN stays NaN.

    The explicit clamp makes overflow (and +-inf) saturate on every device; a
    bare cast is not guaranteed to.
    """
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest E4M3 value, as float32."""
    return e4m3_encode(x).float()


def e4m3_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """The raw E4M3 byte (uint8) of each element of ``x`` after rounding."""
    return e4m3_encode(x).view(torch.uint8)


_E4M3_TABLES: dict[torch.device, torch.Tensor] = {}


def e4m3_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """Float32 values of raw E4M3 bytes (uint8, or already ``float8_e4m3fn``)."""
    b = b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b.to(torch.uint8)
    table = _E4M3_TABLES.get(b.device)
    if table is None:
        every = torch.arange(256, dtype=torch.uint8, device=b.device)
        table = every.view(torch.float8_e4m3fn).float()
        _E4M3_TABLES[b.device] = table
    # The 256 values converted once; a gather per byte is several times faster on
    # CPU than converting float8 per element.
    return torch.index_select(table, 0, b.reshape(-1).to(torch.int32)).view(b.shape)


# ----------------------------------------------------------------- E8M0


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exactly 2^e in float32 for integer e in [-127, 127], built from its bits.

    Built from bits rather than ``exp2`` so the value is exact on every device;
    2^-127 is the float32 subnormal 0x00400000.
    """
    e = e.to(torch.int32)
    normal = (e + E8M0_BIAS).clamp(min=1) << 23
    bits = torch.where(e == E8M0_MIN_EXP, torch.full_like(e, 1 << 22), normal)
    return bits.view(torch.float32)


def e8m0_encode(e: torch.Tensor) -> torch.Tensor:
    """The E8M0 byte (uint8) of the scale 2^e: ``e + 127``, for e in [-127, 127]."""
    return (e.to(torch.int32) + E8M0_BIAS).to(torch.uint8)


_E8M0_TABLES: dict[torch.device, torch.Tensor] = {}


def e8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """Float32 scales 2^(b - 127) of E8M0 bytes (uint8 or ``float8_e8m0fnu``); 0xFF is NaN."""
    if b.dtype == torch.float8_e8m0fnu:
        b = b.view(torch.uint8)
    table = _E8M0_TABLES.get(b.device)
    if table is None:
        every = torch.arange(256, dtype=torch.int32, device=b.device)
        scale = pow2(every.clamp(max=E8M0_BIAS + E8M0_MAX_EXP) - E8M0_BIAS)
        table = torch.where(every == E8M0_NAN_BYTE, torch.full_like(scale, math.nan), scale)
        _E8M0_TABLES[b.device] = table
    # One gather from the 256 scales, instead of five elementwise passes per call.
    flat = torch.index_select(table, 0, b.to(torch.uint8).reshape(-1).to(torch.int32))
    return flat.view(b.shape)


def pow2_exponent(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """Smallest integer e with ``qmax * 2^e >= max(amax, floor)``, clamped to [-127, 127].

    This is ``ceil(log2(max(amax, floor) / qmax))`` computed exactly: with
    ``a = m 2^E`` and ``qmax = mq 2^Eq`` (mantissas in [0.5, 1)), the answer is
    ``E - Eq`` plus one when ``m > mq``. A float log2 can misround next to a
    power of two; frexp cannot. +-inf gives 127; NaN is the caller's to handle.
    """
    mq, eq = math.frexp(qmax)
    a = torch.clamp(amax.float(), min=floor)
    m, ex = torch.frexp(a)
    e = ex.to(torch.int32) - eq + (m > mq).to(torch.int32)
    e = torch.where(torch.isinf(a), torch.full_like(e, E8M0_MAX_EXP), e)
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
