"""KV records: hand-computed bytes, a float64 numpy oracle of the spec formulas, sizes, shapes."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from format_oracles import E4M3, o_e2m1, o_e4m3

from kernels.kv_formats import (
    INDEX_KEY,
    INDEX_KEY_BYTES,
    INDEX_KEY_FP8,
    INDEX_KEY_FP8_BYTES,
    MAIN_KV,
    MAIN_KV_BYTES,
    SWA,
    SWA_BYTES,
    dequantize_index_key,
    dequantize_index_key_fp8,
    dequantize_main_kv,
    dequantize_swa,
    fake_quant_index_key,
    fake_quant_index_key_fp8,
    fake_quant_main_kv,
    fake_quant_swa,
    global_kv_bytes_per_token,
    quantize_index_key,
    quantize_index_key_fp8,
    quantize_main_kv,
    quantize_swa,
    swa_bytes_per_request,
)

SEED = 20260529
NAN = math.nan
INF = math.inf

# ----------------------------------------------------------------- oracles (float64, numpy)


def o_exponent(a: float, qmax: float, floor: float) -> int:
    a = max(a, floor)
    if math.isinf(a):
        return 127
    e = math.ceil(math.log2(a / qmax))
    while qmax * 2.0**e < a:
        e += 1
    while qmax * 2.0 ** (e - 1) >= a:
        e -= 1
    return max(-127, min(127, e))


def o_pack(codes):
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def o_exponents(tiles, qmax, floor):
    amax = np.abs(tiles).max(-1)
    return np.vectorize(lambda a: o_exponent(a, qmax, floor))(amax).astype(np.int64)


def oracle_main_kv(x: np.ndarray) -> np.ndarray:
    t = x.reshape(-1, 32, 16)
    nan = np.isnan(t).any(-1)
    with np.errstate(invalid="ignore"):
        sb = o_e4m3(np.clip(np.abs(t).max(-1) / 6, 2.0**-9, 448.0))
        codes = o_e2m1(t / E4M3[sb & 0x7F][..., None])
    codes[nan] = 0
    sb[nan] = 0x7F
    return np.concatenate([o_pack(codes.reshape(-1, 512)), sb.astype(np.uint8)], 1)


def oracle_index_key(x: np.ndarray) -> np.ndarray:
    t = x.reshape(-1, 4, 32)
    nan = np.isnan(t).any(-1)
    e = o_exponents(np.where(np.isnan(t), 0, t), 6.0, 6.0 * 2.0**-126)
    codes = o_e2m1(t / 2.0 ** e[..., None].astype(np.float64))
    codes[nan] = 0
    sb = np.where(nan, 0xFF, e + 127).astype(np.uint8)
    return np.concatenate([o_pack(codes.reshape(-1, 128)), sb], 1)


def oracle_swa(x: np.ndarray) -> np.ndarray:
    t = x.reshape(-1, 16, 32)
    nan = np.isnan(t).any(-1)
    e = o_exponents(np.where(np.isnan(t), 0, t), 448.0, 1e-4)
    vals = o_e4m3(t / 2.0 ** e[..., None].astype(np.float64))
    vals[nan] = 0
    sb = np.where(nan, 0xFF, e + 127).astype(np.uint8)
    return np.concatenate([vals.reshape(-1, 512).astype(np.uint8), sb], 1)


def oracle_index_key_fp8(x: np.ndarray) -> np.ndarray:
    """The scale and the quotient are fp32 operations by definition of this record."""
    t = x.reshape(-1, 128).astype(np.float32)
    scale = (np.abs(t).max(-1) / np.float32(448)).astype(np.float32)
    scale[scale == 0] = 1.0
    vals = o_e4m3((t / scale[:, None]).astype(np.float64))
    return np.concatenate(
        [vals.astype(np.uint8), scale.astype("<f4").view(np.uint8).reshape(-1, 4)], 1
    )


FORMATS = {
    "main_kv": (quantize_main_kv, dequantize_main_kv, fake_quant_main_kv, oracle_main_kv, MAIN_KV),
    "index_key": (
        quantize_index_key,
        dequantize_index_key,
        fake_quant_index_key,
        oracle_index_key,
        INDEX_KEY,
    ),
    "index_key_fp8": (
        quantize_index_key_fp8,
        dequantize_index_key_fp8,
        fake_quant_index_key_fp8,
        oracle_index_key_fp8,
        INDEX_KEY_FP8,
    ),
    "swa": (quantize_swa, dequantize_swa, fake_quant_swa, oracle_swa, SWA),
}


def e4m3_value(b: int) -> float:
    return math.copysign(E4M3[b & 0x7F], -1.0 if b & 0x80 else 1.0)


def random_rows(n: int, dims: int, seed: int = SEED, lo: int = -8) -> torch.Tensor:
    """Gaussian rows with per-row magnitudes 2^lo .. 2^8."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(lo, 9, (n, 1), generator=g).float())
    return torch.randn(n, dims, generator=g) * mag


# ----------------------------------------------------------------- sizes and layouts


def test_record_sizes_and_layouts():
    assert (MAIN_KV_BYTES, INDEX_KEY_BYTES, INDEX_KEY_FP8_BYTES, SWA_BYTES) == (288, 68, 132, 528)
    assert (MAIN_KV.data_bytes, MAIN_KV.scale_bytes, MAIN_KV.record_bytes) == (256, 32, 288)
    assert (INDEX_KEY.data_bytes, INDEX_KEY.scale_bytes, INDEX_KEY.record_bytes) == (64, 4, 68)
    assert (INDEX_KEY_FP8.data_bytes, INDEX_KEY_FP8.scale_bytes) == (128, 4)
    assert (SWA.data_bytes, SWA.scale_bytes, SWA.record_bytes) == (512, 16, 528)
    # docs/design/architecture.md §1.10: three ratio-2 sources and one ratio-1 source
    # cost 890 B per token
    assert (
        3 * MAIN_KV_BYTES // 2 + MAIN_KV_BYTES + 3 * INDEX_KEY_BYTES // 2 + INDEX_KEY_BYTES == 890
    )


def test_global_kv_bytes_per_token():
    # Hand counts: official (2, 2, 2, 1) -> 3 x 356 / 2 + 356; tiny (2, 1) -> 178 + 356;
    # the bf16 ablation stores 1024 + 256 B per entry.
    assert global_kv_bytes_per_token([2, 2, 2, 1]) == 890
    assert global_kv_bytes_per_token([2, 1]) == 534
    assert global_kv_bytes_per_token([2, 2, 2, 1], "bf16") == 3 * 1280 / 2 + 1280
    assert global_kv_bytes_per_token([2]) == Fraction(356, 2)
    assert swa_bytes_per_request(128, 40) == 128 * 528 * 40
    with pytest.raises(ValueError, match="unknown kv dtype 'fp16'"):
        global_kv_bytes_per_token([1], "fp16")


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("lead", [(0,), (1,), (9,), (2, 3)])
def test_shapes_any_leading_batch(name, lead):
    quant, dequant, fake, _, layout = FORMATS[name]
    x = torch.randn(*lead, layout.dims)
    rec = quant(x)
    assert rec.dtype == torch.uint8 and rec.shape == (*lead, layout.record_bytes)
    out = dequant(rec)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(fake(x), out)


@pytest.mark.parametrize("name", list(FORMATS))
def test_bad_inputs_raise(name):
    quant, dequant, _, _, layout = FORMATS[name]
    with pytest.raises(ValueError):
        quant(torch.randn(2, layout.dims + 2))
    with pytest.raises(ValueError):
        dequant(torch.zeros(2, layout.record_bytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        dequant(torch.zeros(2, layout.record_bytes, dtype=torch.int32))


# ----------------------------------------------------------------- oracle agreement


@pytest.mark.parametrize("name", list(FORMATS))
def test_bytes_match_float64_oracle(name):
    quant, _, _, oracle, layout = FORMATS[name]
    x = random_rows(24, layout.dims)
    rec = quant(x)
    assert rec.numpy().tolist() == oracle(x.double().numpy()).tolist()


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(name, dtype):
    quant, dequant, fake, oracle, layout = FORMATS[name]
    x = random_rows(6, layout.dims, seed=SEED + 1).clamp(-6e4, 6e4).to(dtype)
    rec = quant(x)
    assert torch.equal(rec, quant(x.float()))
    assert rec.numpy().tolist() == oracle(x.double().numpy()).tolist()
    y = fake(x)
    assert y.dtype == dtype
    assert torch.equal(y, dequant(rec).to(dtype))


def test_main_kv_ties_scaled_by_the_rounded_scale():
    """Values placed exactly on E2M1 ties (and one ulp either side) under random tile scales."""
    g = torch.Generator().manual_seed(SEED + 2)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows = []
    for _ in range(8):
        scale = float(E4M3[int(torch.randint(0x20, 0x60, (1,), generator=g))])
        base = torch.cat([ties, -ties, torch.tensor([6.0, 0.5])]) * scale  # 16 values, amax 6*scale
        up, down = torch.nextafter(base, base * 2), torch.nextafter(base, base * 0)
        rows.append(torch.cat([base, up, down] + [base] * 29))
    x = torch.stack(rows)
    assert quantize_main_kv(x).numpy().tolist() == oracle_main_kv(x.double().numpy()).tolist()


# ----------------------------------------------------------------- round-trip error bounds


def test_main_kv_round_trip_bound():
    x = random_rows(16, 512, lo=0)  # normal (not subnormal) E4M3 scales
    err = (dequantize_main_kv(quantize_main_kv(x)) - x).abs().reshape(-1, 32, 16)
    amax = x.abs().reshape(-1, 32, 16).amax(-1, keepdim=True)
    # scale <= (amax/6)(1 + 2^-4) and the largest half-step of the grid is one scale
    assert (err <= amax / 6 * (1 + 2**-4)).all()


def test_index_key_round_trip_bound():
    x = random_rows(16, 128)
    err = (dequantize_index_key(quantize_index_key(x)) - x).abs().reshape(-1, 4, 32)
    amax = x.abs().reshape(-1, 4, 32).amax(-1, keepdim=True)
    assert (err <= amax / 3).all()  # 2^e < 2 amax / 6 and the half-step is at most 2^e


def test_fp8_round_trip_bounds():
    x = random_rows(16, 512)
    t = x.reshape(-1, 16, 32)
    e = torch.ceil(torch.log2(t.abs().amax(-1, keepdim=True).double() / 448))
    err = (dequantize_swa(quantize_swa(x)).reshape(-1, 16, 32) - t).abs().double()
    assert (err <= torch.maximum(t.abs() * 2**-4, torch.exp2(e - 10))).all()

    k = random_rows(16, 128)
    scale = k.abs().amax(-1, keepdim=True).double() / 448
    err = (dequantize_index_key_fp8(quantize_index_key_fp8(k)) - k).abs().double()
    assert (err <= torch.maximum(k.abs() * 2**-4, scale * 2**-9)).all()


# ----------------------------------------------------------------- hand-computed bytes


def test_main_kv_hand_bytes():
    x = torch.zeros(512)
    tile = lambda i, vals: x.__setitem__(slice(16 * i, 16 * i + len(vals)), torch.tensor(vals))  # noqa: E731
    a6 = 18 * 2.0**-9  # amax of a tile whose scale is the E4M3 subnormal 3 * 2^-9
    tile(0, [0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -6, -0.0, -0.1, 0.5, 1.5, 3, 4])
    tile(1, [5376, 2688, 2700, -3000])  # amax/6 = 896 clamps to 448: saturation
    # tile 2: all zero -> scale clamps up to 2^-9
    tile(3, [NAN, 1, 2])  # poisoned
    tile(4, [6.375, -2.0])  # amax/6 = 1.0625 ties between 1.0 and 1.125 -> 1.0
    tile(5, [6.6, 2.8125, -0.5625, 0.28125])  # scale 1.1 -> 1.125; 2.8125/1.125 = 2.5, a tie
    tile(6, [a6, -a6, 3 * 2.0**-9])
    tile(7, [INF, 1.0, -INF])  # inf -> scale 448, saturates
    tile(8, [2.0**-12, -(2.0**-12)])  # below the scale floor: rounds to +-0
    tile(9, [1440, 720, -360])  # scale 240 = 1.875 * 2^7
    data = [0] * 256
    data[0:8] = [0x00, 0x22, 0x44, 0x66, 0xF7, 0x88, 0x31, 0x65]
    data[8:10] = [0x77, 0xF7]
    data[32:33] = [0xC7]
    data[40:42] = [0x47, 0x09]
    data[48:50] = [0xF7, 0x02]
    data[56:58] = [0x07, 0x0F]
    data[64:65] = [0x80]
    data[72:74] = [0x57, 0x0B]
    scales = [0x01] * 32
    scales[:10] = [0x38, 0x7E, 0x01, 0x7F, 0x38, 0x39, 0x03, 0x7E, 0x01, 0x77]
    rec = quantize_main_kv(x[None])
    assert rec[0].tolist() == data + scales

    out = dequantize_main_kv(rec)[0]
    assert torch.isnan(out[48:64]).all() and not torch.isnan(out[:48]).any()
    assert not torch.isnan(out[64:]).any()
    want = {
        0: [0, 0, 1, 1, 2, 2, 4, 4, 6, -6, -0.0, -0.0, 0.5, 1.5, 3, 4],
        1: [2688, 2688, 2688, -2688],
        4: [6.0, -2.0],
        5: [6.75, 2.25, -0.5625, 0.0],
        6: [a6, -a6, 3 * 2.0**-9],
        7: [2688.0, 0.0, -2688.0],
        8: [0.0, -0.0],
        9: [1440, 720, -360],
    }
    for i, vals in want.items():
        assert out[16 * i : 16 * i + len(vals)].tolist() == vals
        assert (out[16 * i + len(vals) : 16 * (i + 1)] == 0).all()
    assert torch.signbit(out[10]) and torch.signbit(out[11])  # sign kept on zero
    assert torch.equal(fake_quant_main_kv(x[None])[0][:48], out[:48])


def test_index_key_hand_bytes():
    x = torch.zeros(2, 128)
    x[0, :16] = torch.tensor(
        [0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -6, -0.0, -0.1, 0.5, 1.5, 3, 4]
    )
    x[0, 32:35] = torch.tensor([6.0001, 3.0, -1.5])  # e = 1; 3.00005 -> 3, -0.75 ties to -1
    # row 1: amax 3 -> e = -1; 6144 = 6 * 2^10 -> e = 10; one ulp above -> e = 11 (value -> 3);
    # a subnormal -> e = -126
    # block 2 all zero: e = -126
    x[0, 100] = NAN
    x[1, 0], x[1, 32], x[1, 64], x[1, 96] = (
        3.0,
        6144.0,
        float(np.nextafter(np.float32(6144), 1e9)),
        1e-40,
    )
    rec = quantize_index_key(x)
    data = [0] * 64
    data[0:8] = [0x00, 0x22, 0x44, 0x66, 0xF7, 0x88, 0x31, 0x65]
    data[16:18] = [0x35, 0x0A]
    assert rec[0].tolist() == [*data, 127, 128, 1, 0xFF]
    assert rec[1, 64:].tolist() == [126, 137, 138, 1]
    assert rec[1, :64].tolist() == [0x07] + [0] * 15 + [0x07] + [0] * 15 + [0x05] + [0] * 31

    out = dequantize_index_key(rec)
    assert out[0, :16].tolist() == [0, 0, 1, 1, 2, 2, 4, 4, 6, -6, -0.0, -0.0, 0.5, 1.5, 3, 4]
    assert out[0, 32:35].tolist() == [6.0, 3.0, -2.0]
    assert (out[0, 64:96] == 0).all()
    assert torch.isnan(out[0, 96:]).all() and not torch.isnan(out[0, :96]).any()
    assert out[1, [0, 32, 64, 96]].tolist() == [3.0, 6144.0, 6144.0, 0.0]


def test_index_key_fp8_hand_bytes():
    x = torch.zeros(5, 128)
    x[0, :3] = torch.tensor([448.0, -224.0, 1.0])
    # row 1 all zero: scale 1.0
    x[2, 7] = NAN
    x[3, :2] = torch.tensor([896.0, 1.0])
    x[4, :2] = torch.tensor([INF, 1.0])  # scale capped at the largest fp32: inf saturates
    rec = quantize_index_key_fp8(x)
    one = [0x00, 0x00, 0x80, 0x3F]  # 1.0f little-endian
    assert rec[0].tolist() == [0x7E, 0xF6, 0x38] + [0] * 125 + one
    assert rec[1].tolist() == [0] * 128 + one
    assert rec[2].tolist() == [0] * 128 + [0x00, 0x00, 0xC0, 0x7F]  # fp32 NaN
    assert rec[3].tolist() == [0x7E, 0x30] + [0] * 126 + [0x00, 0x00, 0x00, 0x40]  # 2.0f
    out = dequantize_index_key_fp8(rec)
    assert out[0, :3].tolist() == [448.0, -224.0, 1.0] and (out[1] == 0).all()
    assert torch.isnan(out[2]).all()
    assert out[3, :2].tolist() == [896.0, 1.0]
    assert rec[4].tolist() == [0x7E] + [0] * 127 + [0xFF, 0xFF, 0x7F, 0x7F]
    assert out[4, 0].item() == INF and (out[4, 1:] == 0).all()


def test_swa_hand_bytes():
    x = torch.zeros(512)
    x[:7] = torch.tensor([448.0, 1.0, -0.0, 0.001, 2.0**-10, 1.5 * 2.0**-10, -224.0])
    # tile 1 all zero: e = ceil(log2(1e-4 / 448)) = -22
    x[64:66] = torch.tensor([449.0, 1.0])  # e = 1
    x[100] = NAN
    x[128:130] = torch.tensor([-INF, 3.0])  # e clamps to 127
    x[160] = 5e-5  # below the amax floor: e = -22, 5e-5 * 2^22 = 209.7 -> 208
    rec = quantize_swa(x[None])[0]
    data = [0] * 512
    data[0:7] = [0x7E, 0x38, 0x80, 0x01, 0x00, 0x01, 0xF6]
    data[64:66] = [0x76, 0x30]
    data[128:130] = [0xFE, 0x00]
    data[160] = 0x75
    scales = [105] * 16
    scales[:6] = [127, 105, 128, 0xFF, 254, 105]
    assert rec.tolist() == data + scales
    out = dequantize_swa(rec[None])[0]
    assert out[:7].tolist() == [448.0, 1.0, -0.0, 2.0**-9, 0.0, 2.0**-9, -224.0]
    assert out[64:66].tolist() == [448.0, 1.0]
    assert torch.isnan(out[96:128]).all() and not torch.isnan(out[:96]).any()
    assert out[128].item() == -INF and out[129].item() == 0.0
    assert out[160].item() == 208 * 2.0**-22
    assert [e4m3_value(b) for b in data[:7]] == out[:7].tolist()


# ----------------------------------------------------------------- devices


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(FORMATS))
def test_cuda_matches_cpu(name):
    quant, dequant, fake, _, layout = FORMATS[name]
    x = random_rows(64, layout.dims)
    x[3, 5] = NAN
    x[4, 1] = INF
    rec = quant(x)
    rec_cuda = quant(x.cuda())
    assert rec_cuda.is_cuda and torch.equal(rec_cuda.cpu(), rec)
    torch.testing.assert_close(
        dequant(rec_cuda).cpu(), dequant(rec), rtol=0, atol=0, equal_nan=True
    )
    y = fake(x.cuda().bfloat16())
    assert y.dtype == torch.bfloat16 and torch.equal(y.cpu(), fake(x.bfloat16()))
