"""Checkpoint weight formats: hand-built bytes, a float64 oracle, ragged shapes, F8_E8M0."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
import torch
from format_oracles import o_e2m1, o_e4m3
from safetensors.torch import load_file, save_file

from kernels.weight_formats import (
    dequantize_fp8_block,
    dequantize_fp8_rows,
    dequantize_mxfp4_weight,
    quantize_fp8_block,
    quantize_fp8_rows,
    quantize_mxfp4_weight,
)

SEED = 4242

# ----------------------------------------------------------------- oracles (float64, numpy)


def o_exponent(a: float, qmax: float) -> int:
    """Smallest e >= -126 with qmax * 2^e >= a."""
    e = -126
    while qmax * 2.0**e < a:
        e += 1
    return e


def random_weight(*shape: int, seed: int = SEED) -> torch.Tensor:
    """Gaussian weights whose rows span several binades, like real checkpoints."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-10, 3, (*shape[:-1], 1), generator=g).float())
    return torch.randn(*shape, generator=g) * mag


def u8(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().astype(np.int64)


# ----------------------------------------------------------------- block FP8


def test_dequantize_fp8_block_hand_bytes():
    w = torch.tensor([[0x38, 0xB8, 0x7E], [0x01, 0x00, 0x40]], dtype=torch.uint8)
    want = [[2.0, -2.0, 896.0], [2.0**-8, 0.0, 4.0]]
    s = torch.tensor([[128]], dtype=torch.uint8)
    for scale in (s, s.view(torch.float8_e8m0fnu), torch.tensor([[2.0]])):
        for weight in (w, w.view(torch.float8_e4m3fn)):
            out = dequantize_fp8_block(weight, scale, torch.float32)
            assert out.tolist() == want
    assert dequantize_fp8_block(w, s).dtype == torch.bfloat16


def test_dequantize_fp8_block_ragged_edges():
    w = torch.full((33, 40), 0x38, dtype=torch.uint8)  # every element 1.0
    scale = torch.tensor([[127, 130], [120, 255]], dtype=torch.uint8)
    out = dequantize_fp8_block(w, scale, torch.float32)
    assert (out[:32, :32] == 1.0).all() and (out[:32, 32:] == 8.0).all()
    assert (out[32:, :32] == 2.0**-7).all() and torch.isnan(out[32:, 32:]).all()
    with pytest.raises(ValueError):
        dequantize_fp8_block(w, scale[:1], torch.float32)


@pytest.mark.parametrize("shape", [(1, 1), (33, 65), (64, 32), (70, 45)])
def test_quantize_fp8_block_matches_oracle(shape):
    w = random_weight(*shape)
    q, s = quantize_fp8_block(w)
    rb, cb = math.ceil(shape[0] / 32), math.ceil(shape[1] / 32)
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (rb, cb)
    wd = w.double().numpy()
    for i in range(rb):
        for j in range(cb):
            block = wd[32 * i : 32 * (i + 1), 32 * j : 32 * (j + 1)]
            e = o_exponent(np.abs(block).max(), 448.0)
            assert u8(s)[i, j] == e + 127
            want = o_e4m3(block / 2.0**e)
            got = u8(q)[32 * i : 32 * (i + 1), 32 * j : 32 * (j + 1)]
            assert got.tolist() == want.tolist()


def test_fp8_block_round_trip_bound_and_special_blocks():
    w = random_weight(70, 45)
    w[32:64, :32] = 0.0  # an all-zero block
    w[5, 40] = math.nan  # poisons block (0, 1)
    q, s = quantize_fp8_block(w)
    assert u8(s)[1, 0] == 1  # e = -126
    assert u8(s)[0, 1] == 0xFF and (u8(q)[:32, 32:] == 0).all()
    out = dequantize_fp8_block(q, s, torch.float32)
    assert torch.isnan(out[:32, 32:]).all()
    assert not torch.isnan(out[32:]).any() and not torch.isnan(out[:32, :32]).any()
    assert (out[32:64, :32] == 0).all()
    ok = ~torch.isnan(out)
    # half an E4M3 step: 2^-4 relative, or 2^-10 of the block scale in the subnormal range
    scale = torch.exp2(s.view(torch.uint8).double() - 127)
    scale = scale.repeat_interleave(32, 0)[:70].repeat_interleave(32, 1)[:, :45]
    err = (out.double() - w.double()).abs()
    bound = torch.maximum(w.double().abs() * 2**-4, scale * 2**-10)
    assert (err[ok] <= bound[ok]).all()


def test_fp8_block_low_precision_input_and_bf16_output():
    w = random_weight(40, 64).bfloat16()
    q, s = quantize_fp8_block(w)
    q32, s32 = quantize_fp8_block(w.float())
    assert (u8(q) == u8(q32)).all()
    assert (u8(s) == u8(s32)).all()
    out = dequantize_fp8_block(q, s)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, dequantize_fp8_block(q, s, torch.float32).bfloat16())


def test_scales_survive_safetensors_as_f8_e8m0(tmp_path):
    q, s = quantize_fp8_block(random_weight(40, 70))
    p, ps = quantize_mxfp4_weight(random_weight(3, 64))
    path = tmp_path / "w.safetensors"
    save_file({"a.weight": q, "a.scale": s, "b.weight": p, "b.scale": ps}, str(path))
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    dtypes = {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes == {
        "a.weight": "F8_E4M3",
        "a.scale": "F8_E8M0",
        "b.weight": "I8",
        "b.scale": "F8_E8M0",
    }
    back = load_file(str(path))
    assert back["a.scale"].dtype == torch.float8_e8m0fnu
    assert torch.equal(
        dequantize_fp8_block(back["a.weight"], back["a.scale"]), dequantize_fp8_block(q, s)
    )


# ----------------------------------------------------------------- MXFP4 experts


def test_dequantize_mxfp4_hand_bytes():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    packed[0, :3] = torch.tensor([0x21, 0xF7, 0x80], dtype=torch.uint8)
    packed[1, 0] = 0x77
    scale = torch.tensor([[129], [255]], dtype=torch.uint8)
    out = dequantize_mxfp4_weight(
        packed.view(torch.int8), scale.view(torch.float8_e8m0fnu), torch.float32
    )
    assert out.shape == (2, 32)
    assert out[0, :6].tolist() == [2.0, 4.0, 24.0, -24.0, 0.0, -0.0]
    assert torch.signbit(out[0, 5]) and (out[0, 6:] == 0).all()
    assert torch.isnan(out[1]).all()
    with pytest.raises(ValueError):
        dequantize_mxfp4_weight(packed, scale[:, :0], torch.float32)


def test_quantize_mxfp4_matches_oracle():
    w = random_weight(2, 3, 64)  # [experts, out, in]
    w[0, 0, :4] = torch.tensor([6.0, 0.75, -0.25, 2.5])  # ties: 0.75 -> 1, -0.25 -> -0, 2.5 -> 2
    w[0, 0, 4:32] = 0.0
    p, s = quantize_mxfp4_weight(w)
    assert p.dtype == torch.int8 and p.shape == (2, 3, 32)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3, 2)
    assert u8(p)[0, 0, :2].tolist() == [0x27, 0x48]  # codes (7, 2), (8, 4)
    assert u8(s)[0, 0, 0] == 127
    blocks = w.double().numpy().reshape(2, 3, 2, 32)
    e = np.vectorize(lambda a: o_exponent(a, 6.0))(np.abs(blocks).max(-1))
    assert (u8(s) == e + 127).all()
    codes = o_e2m1(blocks / 2.0 ** e[..., None].astype(np.float64)).reshape(2, 3, 64)
    assert (u8(p) == (codes[..., 0::2] | (codes[..., 1::2] << 4))).all()

    out = dequantize_mxfp4_weight(p, s, torch.float32)
    assert out.shape == w.shape
    amax = w.abs().reshape(2, 3, 2, 32).amax(-1, keepdim=True)
    err = (out - w).abs().reshape(2, 3, 2, 32)
    assert (err <= amax / 3).all()  # 2^e < amax / 3 and a half-step is at most 2^e


def test_mxfp4_nan_and_bad_shapes():
    w = random_weight(4, 64)
    w[2, 40] = math.nan
    p, s = quantize_mxfp4_weight(w)
    assert u8(s)[2].tolist()[1] == 0xFF and (u8(p)[2, 16:] == 0).all()
    out = dequantize_mxfp4_weight(p, s, torch.float32)
    assert torch.isnan(out[2, 32:]).all() and not torch.isnan(out[2, :32]).any()
    assert not torch.isnan(out[[0, 1, 3]]).any()
    with pytest.raises(ValueError):
        quantize_mxfp4_weight(torch.randn(4, 48))


# ----------------------------------------------------------------- FP8 rows (Engram)


def test_dequantize_fp8_rows_hand_bytes():
    w = torch.tensor([[0x38] * 32 + [0xC0] * 32], dtype=torch.uint8)
    scale = torch.tensor([[126, 131]], dtype=torch.uint8)
    out = dequantize_fp8_rows(w.view(torch.float8_e4m3fn), scale, torch.float32)
    assert out[0, :32].tolist() == [0.5] * 32 and out[0, 32:].tolist() == [-32.0] * 32


def test_quantize_fp8_rows_matches_oracle_and_gathers():
    w = random_weight(5, 2, 64)  # [rows, heads, head_dim] leading dims are fine
    q, s = quantize_fp8_rows(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (5, 2, 2)
    blocks = w.double().numpy().reshape(5, 2, 2, 32)
    e = np.vectorize(lambda a: o_exponent(a, 448.0))(np.abs(blocks).max(-1))
    assert (u8(s) == e + 127).all()
    want = o_e4m3(blocks / 2.0 ** e[..., None].astype(np.float64)).reshape(5, 2, 64)
    assert (u8(q) == want).all()
    out = dequantize_fp8_rows(q, s, torch.float32)
    err = (out - w).abs().double()
    scale = torch.exp2(torch.tensor(e, dtype=torch.float64)).repeat_interleave(32, -1)
    assert (err <= torch.maximum(w.abs().double() * 2**-4, scale * 2**-10)).all()
    # a gathered subset of rows decodes to the same values (tables are read row by row)
    idx = torch.tensor([4, 1])
    assert torch.equal(dequantize_fp8_rows(q[idx], s[idx], torch.float32), out[idx])
    with pytest.raises(ValueError):
        quantize_fp8_rows(torch.randn(3, 40))
