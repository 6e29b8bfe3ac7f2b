"""Scalar formats against hand values and an independent float64 nearest-grid oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kernels.quant import (
    e2m1_decode,
    e2m1_encode,
    e4m3_from_bytes,
    e4m3_round,
    e4m3_to_bytes,
    e8m0_decode,
    e8m0_encode,
    pack_nibbles,
    pow2,
    pow2_exponent,
    unpack_nibbles,
)

SEED = 1234

# ----------------------------------------------------------------- oracles (float64, numpy)

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nearest_even(mag: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest table entry; on a tie the even index (even mantissa bit)."""
    d = np.abs(mag[..., None] - table)
    tied = d == d.min(-1, keepdims=True)
    even = tied & (np.arange(len(table)) % 2 == 0)
    return np.where(even.any(-1), even.argmax(-1), tied.argmax(-1))


def oracle_e2m1(v: np.ndarray) -> np.ndarray:
    return nearest_even(np.abs(v), GRID) | (np.signbit(v).astype(np.int64) << 3)


def e4m3_table() -> np.ndarray:
    """Values of bytes 0x00..0x7E from the bit layout S.EEEE.MMM, bias 7."""
    out = []
    for b in range(0x7F):
        exp, man = b >> 3, b & 7
        out.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return np.array(out)


E4M3 = e4m3_table()


def oracle_e4m3_bytes(v: np.ndarray) -> np.ndarray:
    mag = np.minimum(np.abs(v), 448.0)
    return nearest_even(mag, E4M3) | (np.signbit(v).astype(np.int64) << 7)


def oracle_exponent(amax: float, qmax: float, floor: float) -> int:
    """Smallest e with qmax * 2^e >= max(amax, floor), by search from a float log2 guess."""
    a = max(amax, floor)
    if math.isinf(a):
        return 127
    e = math.ceil(math.log2(a / qmax))
    while qmax * 2.0**e < a:
        e += 1
    while qmax * 2.0 ** (e - 1) >= a:
        e -= 1
    return max(-127, min(127, e))


# ----------------------------------------------------------------- E2M1


def test_e2m1_encode_hand_values():
    x = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0]
    want = [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 7]
    assert e2m1_encode(torch.tensor(x)).tolist() == want
    neg = [-0.0, -0.1, -0.25, -0.3, -0.75, -5.0, -5.5, -1e30, -math.inf, math.inf]
    want_neg = [0x8, 0x8, 0x8, 0x9, 0xA, 0xE, 0xF, 0xF, 0xF, 0x7]
    assert e2m1_encode(torch.tensor(neg)).tolist() == want_neg
    assert e2m1_encode(torch.tensor([math.nan])).tolist() == [0]


def test_e2m1_encode_matches_oracle_including_ties():
    g = torch.Generator().manual_seed(SEED)
    mids = (GRID[1:] + GRID[:-1]) / 2
    near = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, 7), GRID, [6.5, 100]])
    x = np.concatenate([near, -near, (torch.randn(4000, generator=g) * 3).numpy()])
    x32 = torch.tensor(x, dtype=torch.float32)
    want = oracle_e2m1(x32.double().numpy())
    assert e2m1_encode(x32).numpy().tolist() == want.tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e2m1_encode_low_precision_inputs(dtype):
    x = (torch.randn(300, generator=torch.Generator().manual_seed(SEED)) * 3).to(dtype)
    assert e2m1_encode(x).tolist() == oracle_e2m1(x.double().numpy()).tolist()


def test_e2m1_decode_all_codes():
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert got.dtype == torch.float32
    assert got.tolist() == want
    assert torch.signbit(got[8])  # code 0x8 is -0.0


def test_pack_nibbles_hand_bytes():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    assert unpack_nibbles(packed).tolist() == codes.tolist()
    assert unpack_nibbles(packed.view(torch.int8)).tolist() == codes.tolist()


def test_pack_unpack_round_trip_and_odd_width():
    codes = torch.randint(0, 16, (3, 5, 64), generator=torch.Generator().manual_seed(SEED))
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), codes.to(torch.uint8))
    with pytest.raises(ValueError):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


# ----------------------------------------------------------------- E4M3


def test_e4m3_hand_bytes():
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, 448.0, 500.0, -1e9, math.inf, 224.0, 2.0**-9, 2.0**-10])
    want = [0x00, 0x80, 0x38, 0xB8, 0x7E, 0x7E, 0xFE, 0x7E, 0x76, 0x01, 0x00]
    assert e4m3_to_bytes(x).tolist() == want
    assert e4m3_to_bytes(torch.tensor([math.nan])).item() & 0x7F == 0x7F
    assert torch.isnan(e4m3_from_bytes(torch.tensor([0x7F, 0xFF], dtype=torch.uint8))).all()


def test_e4m3_rounding_matches_oracle_including_ties():
    mids = (E4M3[1:] + E4M3[:-1]) / 2  # every tie between neighbours
    g = torch.Generator().manual_seed(SEED)
    rnd = torch.randn(3000, generator=g) * torch.exp2(torch.randint(-12, 9, (3000,), generator=g))
    x = np.concatenate([E4M3, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e3), rnd.numpy()])
    x = np.concatenate([x, -x])
    x32 = torch.tensor(x, dtype=torch.float32)
    want = oracle_e4m3_bytes(x32.double().numpy())
    assert e4m3_to_bytes(x32).numpy().tolist() == want.tolist()
    # decoding a byte gives the table value back
    assert e4m3_from_bytes(torch.tensor(want, dtype=torch.uint8)).double().numpy().tolist() == [
        math.copysign(E4M3[b & 0x7F], -1.0 if b & 0x80 else 1.0) for b in want
    ]
    assert torch.equal(e4m3_round(x32), e4m3_from_bytes(e4m3_to_bytes(x32)))


# ----------------------------------------------------------------- E8M0


def test_pow2_is_exact_over_the_whole_range():
    e = torch.arange(-127, 128)
    got = pow2(e).double().tolist()
    assert got == [2.0**k for k in range(-127, 128)]


def test_e8m0_bytes_and_decode():
    assert e8m0_encode(torch.tensor([-127, -1, 0, 1, 127])).tolist() == [0, 126, 127, 128, 254]
    b = torch.arange(256).to(torch.uint8)
    got = e8m0_decode(b)
    assert got[:255].double().tolist() == [2.0 ** (k - 127) for k in range(255)]
    assert torch.isnan(got[255])
    # torch's own float8_e8m0fnu conversion is a second code path
    from_e8m0 = e8m0_decode(b.view(torch.float8_e8m0fnu))
    torch.testing.assert_close(from_e8m0, got, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(b.view(torch.float8_e8m0fnu).float()[:255], got[:255])


@pytest.mark.parametrize(("qmax", "floor"), [(6.0, 6.0 * 2.0**-126), (448.0, 1e-4), (448.0, 0.0)])
def test_pow2_exponent_matches_oracle(qmax, floor):
    g = torch.Generator().manual_seed(SEED)
    rnd = torch.rand(2000, generator=g) * torch.exp2(torch.randint(-140, 120, (2000,), generator=g))
    edges = torch.tensor([qmax * 2.0**k for k in range(-120, 100, 7)])
    edge_up = torch.nextafter(edges, torch.tensor(math.inf))
    edge_dn = torch.nextafter(edges, torch.tensor(0.0))
    amax = torch.cat([rnd, edges, edge_up, edge_dn, torch.tensor([0.0, 1e-4, math.inf])])
    amax = amax.float()
    if floor == 0.0:
        amax = amax[amax > 0]
    got = pow2_exponent(amax, qmax, floor).tolist()
    want = [oracle_exponent(a, qmax, floor) for a in amax.double().tolist()]
    assert got == want


def test_pow2_exponent_hand_values():
    a = torch.tensor([6.0, 6.0001, 3.0, 0.0, 448 * 1024.0])
    assert pow2_exponent(a, 6.0, 6.0 * 2.0**-126).tolist() == [0, 1, -1, -126, 17]
    assert pow2_exponent(torch.tensor([448.0, 449.0, 0.0]), 448.0, 1e-4).tolist() == [0, 1, -22]


def test_packed_decode_equals_unpack_then_decode_for_every_byte():
    from kernels.quant import e2m1_decode, e2m1_decode_packed, unpack_nibbles

    every = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    expected = e2m1_decode(unpack_nibbles(every))
    got = e2m1_decode_packed(every)
    assert got.shape == (8, 64)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))
    assert torch.equal(got, expected)
    assert torch.equal(e2m1_decode_packed(every.view(torch.int8)), expected)
