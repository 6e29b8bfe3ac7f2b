"""Grouped MXFP4 GEMM of the fused MoE: the CPU path and the Triton kernel (interpreted, in a
child process) against the float64 oracle of the same arithmetic (E4M3 activations, MXFP4
weights, products summed). Seeds are fresh each run and printed (``FLASHSERVE_TEST_SEED``
replays one)."""

from __future__ import annotations

import os
import secrets

import pytest
import torch
from interpreter import INTERPRETED, interpreted, run_triton_tests_in_child

from kernels import dispatch
from kernels import moe_ops as moe_ops_module
from kernels.act_quant import dequantize_act_fp8, quantize_act_fp8
from kernels.moe_ops import (
    expert_chunks,
    grouped_mxfp4_matmul,
    grouped_mxfp4_matmul_cpu,
    grouped_mxfp4_matmul_float64,
    grouped_mxfp4_matmul_reference,
)
from kernels.weight_formats import dequantize_mxfp4_weight, quantize_mxfp4_weight


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("FLASHSERVE_TEST_SEED", secrets.randbits(31)))
    print(f"seed={value}")
    return value


def grouped_case(g: torch.Generator, counts: list[int], n: int, k: int):
    """Rows sorted by expert (``counts`` per expert, zeros allowed), weights in MXFP4."""
    e = len(counts)
    m = sum(counts)
    # Row magnitudes spread over 2^-6..2^6 so the activation scales differ per block.
    x = torch.randn(m, k // 32, 32, generator=g)
    x = (x * 2.0 ** torch.randint(-6, 7, (m, k // 32, 1), generator=g)).flatten(1)
    w = torch.randn(e, n, k, generator=g) * 2.0 ** torch.randint(-4, 5, (e, n, 1), generator=g)
    q, s = quantize_mxfp4_weight(w)
    offsets = torch.zeros(e + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(counts), 0)
    return x, offsets, q, s.view(torch.uint8)


def fp32_bound(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, offsets: torch.Tensor):
    """Worst-case fp32 summation error of each output: K * 2^-24 * sum_k |a_k w_k|
    (every product is exact; only the K additions round)."""
    a = dequantize_act_fp8(*quantize_act_fp8(x)).double().abs()
    bound = torch.zeros(x.shape[0], q.shape[1], dtype=torch.float64)
    bounds = offsets.tolist()
    for e in range(q.shape[0]):
        w = dequantize_mxfp4_weight(q[e], s[e], torch.float64).abs()
        bound[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]] @ w.T
    return bound * x.shape[1] * 2.0**-24 + 1e-30


def test_cpu_path_decodes_hand_computed_bytes():
    # Byte 0x2F: low nibble 0xF = -6 (element 0), high nibble 0x2 = 1.0 (element 1).
    # Byte 0x07: 6.0 then 0. Scale bytes 128 = 2^1, so the row is 2x these. A one-hot
    # activation row reads the decoded weight back out of the CPU path's tables.
    q = torch.tensor([[[0x2F, 0x07] * 16]], dtype=torch.uint8).view(torch.int8)
    s = torch.tensor([[[128, 128]]], dtype=torch.uint8)  # one per block of 32
    a = torch.eye(64)[:8]
    got = grouped_mxfp4_matmul_cpu(a, torch.tensor([0, 8]), q, s, [8]).view(-1)
    assert got[:4].tolist() == [-12.0, 2.0, 12.0, 0.0]
    assert torch.equal(got[4:8], got[:4])


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 7, 0], [1], [0, 2]])
def test_reference_equals_float64_oracle_to_fp32_rounding(seed, counts):
    g = torch.Generator().manual_seed(seed)
    x, offsets, q, s = grouped_case(g, counts, n=40, k=96)
    values, scales = quantize_act_fp8(x)
    got = grouped_mxfp4_matmul_reference(values, scales, offsets, q, s)
    want = grouped_mxfp4_matmul_float64(x, offsets, q, s)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], 40)
    assert ((got.double() - want).abs() <= fp32_bound(x, q, s, offsets)).all()
    # The host counts give the same loop.
    again = grouped_mxfp4_matmul_reference(values, scales, offsets, q, s, counts)
    assert torch.equal(again, got)


@pytest.mark.parametrize("per_chunk", [1, 2, 100])
def test_chunked_decode_equals_one_expert_at_a_time_bitwise(seed, per_chunk, monkeypatch):
    """Decoding the active experts together (in chunks of 1, 2 or all) gives the bits of
    the loop that decodes one expert's tile at a time and multiplies its rows."""
    g = torch.Generator().manual_seed(seed)
    counts = [2, 0, 3, 1, 0, 4]
    x, offsets, q, s = grouped_case(g, counts, n=64, k=96)
    a = dequantize_act_fp8(*quantize_act_fp8(x))
    want = torch.empty(x.shape[0], 64)
    bounds = offsets.tolist()
    for e in range(len(counts)):
        if counts[e]:
            tile = dequantize_mxfp4_weight(q[e], s[e], torch.float32)
            want[bounds[e] : bounds[e + 1]] = a[bounds[e] : bounds[e + 1]] @ tile.T
    monkeypatch.setattr(moe_ops_module, "TILE_ELEMENTS", per_chunk * 64 * 96)
    chunks = expert_chunks(offsets, counts, 64 * 96, q.device)
    assert [len(r) for _, r in chunks.chunks] == [
        min(per_chunk, 4 - i) for i in range(0, 4, per_chunk)
    ]
    assert torch.equal(grouped_mxfp4_matmul_cpu(a, offsets, q, s, counts), want)
    assert torch.equal(grouped_mxfp4_matmul_cpu(a, offsets, q, s, chunks=chunks), want)


def test_oracle_quantises_the_activation_for_real(seed):
    """The oracle is not the unquantised product: E4M3 rounding moves the result."""
    g = torch.Generator().manual_seed(seed)
    x, offsets, q, s = grouped_case(g, [4, 4], n=32, k=64)
    exact = torch.cat(
        [
            x[r0:r1].double() @ dequantize_mxfp4_weight(q[e], s[e], torch.float64).T
            for e, (r0, r1) in enumerate(((0, 4), (4, 8)))
        ]
    )
    want = grouped_mxfp4_matmul_float64(x, offsets, q, s)
    rel = (want - exact).norm() / exact.norm()
    assert 1e-4 < rel < 2**-4


def test_bad_shapes_are_refused():
    x = torch.randn(4, 64)
    values, scales = quantize_act_fp8(x)
    q = torch.zeros(2, 8, 16, dtype=torch.int8)  # K = 32, not 64
    s = torch.zeros(2, 8, 1, dtype=torch.uint8)
    offsets = torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="does not fit"):
        grouped_mxfp4_matmul(values, scales, offsets, q, s)
    q = torch.zeros(2, 8, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="weight scales"):
        grouped_mxfp4_matmul(values, scales, offsets, q, s)
    with pytest.raises(ValueError, match="offsets"):
        grouped_mxfp4_matmul(
            values, scales, offsets[:2], q, torch.zeros(2, 8, 2, dtype=torch.uint8)
        )


# ----------------------------------------------------------------- Triton (interpreted)


@pytest.mark.skipif(INTERPRETED, reason="the child itself")
def test_triton_kernels_interpreted():
    """This file's Triton tests, run in a TRITON_INTERPRET=1 child (triton is a dependency)."""
    run_triton_tests_in_child(__file__)


@interpreted
def test_triton_tile_map_covers_every_row_once():
    from kernels.triton.grouped_mxfp4 import tile_map

    offsets = torch.tensor([0, 3, 3, 20, 21])  # 3, 0, 17, 1 rows
    expert, row0, row1 = tile_map(offsets, 16, 21)
    used = row1 > row0
    tiles = sorted(
        zip(expert[used].tolist(), row0[used].tolist(), row1[used].tolist(), strict=True)
    )
    assert tiles == [(0, 0, 3), (2, 3, 20), (2, 19, 20), (3, 20, 21)]
    assert expert.numel() == min(21, 2 + 4)


@interpreted
@pytest.mark.parametrize(
    "counts, n, k",
    [([3, 0, 18, 1], 40, 64), ([0, 0, 5], 64, 32), ([17], 70, 96)],
)
def test_triton_grouped_gemm_equals_float64_oracle(seed, counts, n, k):
    from kernels.triton.grouped_mxfp4 import grouped_mxfp4_matmul_triton

    g = torch.Generator().manual_seed(seed)
    x, offsets, q, s = grouped_case(g, counts, n=n, k=k)
    values, scales = quantize_act_fp8(x)
    got = grouped_mxfp4_matmul_triton(values, scales, offsets, q, s)
    want = grouped_mxfp4_matmul_float64(x, offsets, q, s)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], n)
    assert ((got.double() - want).abs() <= fp32_bound(x, q, s, offsets)).all()


@interpreted
def test_public_op_dispatches_to_triton(seed, monkeypatch):
    from kernels.triton import grouped_mxfp4

    calls = []
    real = grouped_mxfp4.grouped_mxfp4_matmul_triton

    def spy(*args, **kwargs):
        calls.append("triton")
        return real(*args, **kwargs)

    monkeypatch.setattr(grouped_mxfp4, "grouped_mxfp4_matmul_triton", spy)
    g = torch.Generator().manual_seed(seed)
    x, offsets, q, s = grouped_case(g, [2, 3], n=32, k=32)
    values, scales = quantize_act_fp8(x)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    got = grouped_mxfp4_matmul(values, scales, offsets, q, s)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    ref = grouped_mxfp4_matmul(values, scales, offsets, q, s)
    assert calls == ["triton"]
    assert ((got.double() - ref.double()).abs() <= 2 * fp32_bound(x, q, s, offsets)).all()
    assert moe_ops_module.use_triton is dispatch.use_triton


@pytest.mark.skipif(INTERPRETED, reason="compiles the real kernel; the child interprets it")
def test_grouped_gemm_compiles_for_hopper():
    """Types, layouts, the fp16 ``tl.dot`` and shared memory, checked by ptxas (no GPU needed)."""
    from test_sparse_attention import _hopper_compile

    from kernels.triton import grouped_mxfp4

    u8, i32, f32 = "*u8", "*i32", "*fp32"
    pointers = {
        "a_ptr": u8,
        "as_ptr": f32,
        "w_ptr": u8,
        "ws_ptr": u8,
        "out_ptr": f32,
        "tile_expert_ptr": i32,
        "tile_row0_ptr": i32,
        "tile_row1_ptr": i32,
    }
    compiled = _hopper_compile(
        grouped_mxfp4._grouped_mxfp4_kernel,
        pointers,
        {"BLOCK_M": 16, "BLOCK_N": 64},
        fp_fusion=False,
    )
    assert compiled.asm.get("cubin")
    assert compiled.metadata.shared <= 227 * 1024


@interpreted
def test_packed_experts_run_the_triton_kernel_end_to_end(seed, monkeypatch):
    """The packed ``RoutedExperts`` forward through the interpreted kernel (offsets only,
    no host counts) equals its CPU loop; an expert without rows is skipped by both."""
    from engine.model.deepseek_v41.routed_experts import RoutedExperts

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    experts = RoutedExperts(4, 64, 32, swiglu_limit=1.0)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.2, generator=g)
    packed = experts.packed_copy()
    x = torch.randn(6, 64, generator=g) * 3
    idx = torch.tensor([[0, 2], [2, 0], [3, 2], [0, 3], [2, 3], [3, 0]])  # expert 1: no row
    weights = torch.rand(6, 2, generator=g)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    want = packed(x, weights, idx)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    got = packed(x, weights, idx)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want.abs().max() > 0.1
