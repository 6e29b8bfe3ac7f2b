"""In-kernel codecs for the KV record formats (the Triton side of ``kernels.quant``).

Values are built from their IEEE bits rather than with ``exp2`` or a lookup
table so every decode is exact on every backend (and in the interpreter).
Arguments are int32 tensors of byte or code values; results are float32.
Encoders match the PyTorch quantisers bit for bit, including ties.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_value(code):
    """E2M1 code (0..15; bit 3 is the sign) -> float32: 0, .5, 1, 1.5, 2, 3, 4, 6."""
    e = (code >> 1) & 3
    m = code & 1
    normal = ((e + 126) << 23) | (m << 22)  # 2^(e-1) * (1 + m/2)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal.to(tl.float32, bitcast=True))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def e4m3_value(byte):
    """float8_e4m3fn byte -> float32 (0x7F / 0xFF are NaN)."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = ((byte & 0x80) << 24) | ((e + 120) << 23) | (m << 20)
    sub = m.to(tl.float32) * 0.001953125  # subnormals are m * 2^-9
    sub = tl.where((byte & 0x80) != 0, -sub, sub)
    value = tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def e8m0_value(byte):
    """UE8M0 byte -> 2^(byte - 127) as float32 (byte 0 is the subnormal 2^-127, 0xFF NaN)."""
    bits = tl.where(byte == 0, 1 << 22, byte << 23)
    return tl.where(byte == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def pow2(e):
    """Exactly 2^e as float32 for int32 e in [-127, 127]."""
    bits = tl.where(e == -127, 1 << 22, (tl.maximum(e, -126) + 127) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_code(x):
    """E2M1 code of float32 x: round half to even, saturate at 6, sign from the sign bit.

    Midpoints between grid values; a tie goes to the even code (strict ``>``
    above an even code, ``>=`` above an odd one). NaN gives 0.
    """
    mag = tl.abs(x)
    code = (mag > 0.25).to(tl.int32)
    code += (mag >= 0.75).to(tl.int32)
    code += (mag > 1.25).to(tl.int32)
    code += (mag >= 1.75).to(tl.int32)
    code += (mag > 2.5).to(tl.int32)
    code += (mag >= 3.5).to(tl.int32)
    code += (mag > 5.0).to(tl.int32)
    negative = (x.to(tl.int32, bitcast=True) < 0) & (x == x)
    return code | (negative.to(tl.int32) << 3)


@triton.jit
def e4m3_round_positive(x):
    """Positive finite float32 x <= 448 rounded half-to-even to the nearest E4M3 value."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal range (x >= 2^-6): keep 3 of 23 mantissa bits, ties to even; a
    # carry into the exponent is the correct rounding.
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) >> 20) << 20
    # Subnormal range: multiples of 2^-9. y = x * 512 is exact.
    y = x * 512.0
    whole = y.to(tl.int32)
    frac = y - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    sub = (whole + up.to(tl.int32)).to(tl.float32) * 0.001953125
    return tl.where(x < 0.015625, sub, normal.to(tl.float32, bitcast=True))


@triton.jit
def e4m3_byte_positive(v):
    """The float8_e4m3fn byte of a positive value v that is already an E4M3 value."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((((bits >> 23) & 255) - 120) << 3) | ((bits >> 20) & 7)
    return tl.where(v < 0.015625, (v * 512.0).to(tl.int32), normal)


@triton.jit
def mxfp4_exponent(amax):
    """``ceil(log2(max(amax, 6 * 2^-126) / 6))`` exactly, clamped to [-127, 127]; inf gives 127.

    With a = 1.f * 2^E: a / 6 = (1.f / 1.5) * 2^(E - 2), so e = E - 2, plus one
    when 1.f > 1.5.
    """
    a = tl.maximum(amax, 6.0 * 1.1754943508222875e-38)
    bits = a.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 255) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
    e = tl.where(a == float("inf"), 127, e)
    return tl.minimum(tl.maximum(e, -127), 127)
