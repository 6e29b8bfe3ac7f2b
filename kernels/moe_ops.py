"""Grouped GEMM over the packed MXFP4 routed experts (the fused MoE's matmul).

Rows arrive sorted by expert: expert ``e`` owns rows ``offsets[e]:offsets[e+1]``
of the activation. Each expert's weight is the checkpoint's MXFP4 bytes (E2M1
pairs ``int8 [E, N, K/2]``, UE8M0 scale bytes ``uint8 [E, N, K/32]``). The
release's numerics: the activation is quantised to E4M3 per block of 32
(``kernels.act_quant``), each product of an E4M3 and an E2M1 value is exact,
and the dot products accumulate in fp32 (docs/design/kernels.md, "Fused MoE").

The public op runs the Triton grouped GEMM (one launch over every active
expert) or the CPU reference, which dequantises the weights of the experts that
received rows a chunk of experts at a time and multiplies each expert's rows
(``kernels.dispatch``). ``grouped_mxfp4_matmul_float64`` is the oracle: the same
quantised operands multiplied and summed in float64.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kernels.act_quant import dequantize_act_fp8, quantize_act_fp8
from kernels.dispatch import use_triton
from kernels.quant import e2m1_decode, e8m0_decode, unpack_nibbles
from kernels.weight_formats import BLOCK, dequantize_mxfp4_weight


def _check(
    a_values: torch.Tensor,
    a_scales: torch.Tensor,
    offsets: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
) -> None:
    e, n, half_k = w.shape
    k = a_values.shape[-1]
    if a_values.dim() != 2 or k != 2 * half_k or k % BLOCK:
        raise ValueError(f"activation {tuple(a_values.shape)} does not fit weight {tuple(w.shape)}")
    if tuple(a_scales.shape) != (a_values.shape[0], k // BLOCK):
        raise ValueError(
            f"activation scales {tuple(a_scales.shape)}, want {(a_values.shape[0], k // BLOCK)}"
        )
    if tuple(w_scale.shape) != (e, n, k // BLOCK):
        raise ValueError(f"weight scales {tuple(w_scale.shape)}, want {(e, n, k // BLOCK)}")
    if tuple(offsets.shape) != (e + 1,):
        raise ValueError(f"offsets {tuple(offsets.shape)}, want ({e + 1},)")


def grouped_mxfp4_matmul(
    a_values: torch.Tensor,
    a_scales: torch.Tensor,
    offsets: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    counts: list[int] | None = None,
) -> torch.Tensor:
    """fp32 ``[M, N]``: row r of expert e is ``dequant(a[r]) @ dequant(w[e]).T``.

    ``a_values`` / ``a_scales``: ``quantize_act_fp8`` of the expert-sorted rows
    ``[M, K]``; ``offsets`` ``Long[E + 1]`` on the rows' device; ``counts``: the
    rows per expert on the host, when the caller already has them (the CPU loop
    needs them; the Triton path never syncs for them).
    """
    _check(a_values, a_scales, offsets, w, w_scale)
    if use_triton(a_values, w, op="moe_gemm"):
        from kernels.triton.grouped_mxfp4 import grouped_mxfp4_matmul_triton

        return grouped_mxfp4_matmul_triton(a_values, a_scales, offsets, w, w_scale)
    return grouped_mxfp4_matmul_reference(a_values, a_scales, offsets, w, w_scale, counts)


def _active(offsets: torch.Tensor, counts: list[int] | None) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert that received rows."""
    if counts is None:
        bounds = offsets.tolist()
    else:
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
    return [(e, r0, r1) for e, (r0, r1) in enumerate(itertools.pairwise(bounds)) if r1 > r0]


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _decode_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[256, 2]`` (both E2M1 values of every byte) and ``[256]`` (every E8M0 byte).

    3 KiB, so they stay in L1 under any load. A table of every byte pair (1 MiB,
    half the lookups) measured no faster on a busy host: its lookups miss the cache.
    """
    if device not in _TABLES:
        every = torch.arange(256, dtype=torch.uint8, device=device)
        pairs = e2m1_decode(unpack_nibbles(every[:, None])).contiguous()
        _TABLES[device] = (pairs, e8m0_decode(every).contiguous())
    return _TABLES[device]


def grouped_mxfp4_matmul_reference(
    a_values: torch.Tensor,
    a_scales: torch.Tensor,
    offsets: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    counts: list[int] | None = None,
) -> torch.Tensor:
    """The CPU path: per active expert, its weight dequantised (exact, fp32), one matmul."""
    a = dequantize_act_fp8(a_values, a_scales)  # exact: E4M3 times a power of two
    return grouped_mxfp4_matmul_cpu(a, offsets, w, w_scale, counts)


# fp32 weight elements the CPU path dequantises at once (16 MiB): every active
# expert of a tiny-model layer in one pass; one expert at a time at the release's size.
TILE_ELEMENTS = 1 << 22


@dataclass(frozen=True, slots=True)
class ExpertChunks:
    """The active experts of a step, in chunks decoded together: for each chunk the
    experts' ids (int32, on the weights' device) and their ``(first row, end row)``."""

    chunks: list[tuple[torch.Tensor, list[tuple[int, int]]]]


def expert_chunks(
    offsets: torch.Tensor,
    counts: list[int] | None,
    weight_elements: int,
    device: torch.device,
) -> ExpertChunks:
    """Chunks of the experts that received rows, ``TILE_ELEMENTS`` fp32 weights at most each
    (one expert at least). A MoE layer's three projections share one: each has
    ``weight_elements = dim * inter_dim`` per expert."""
    active = _active(offsets, counts)
    per_chunk = max(1, TILE_ELEMENTS // max(weight_elements, 1))
    chunks = []
    for c0 in range(0, len(active), per_chunk):
        part = active[c0 : c0 + per_chunk]
        ids = torch.tensor([e for e, _, _ in part], dtype=torch.int32, device=device)
        chunks.append((ids, [(r0, r1) for _, r0, r1 in part]))
    return ExpertChunks(chunks)


def grouped_mxfp4_matmul_cpu(
    a: torch.Tensor,
    offsets: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    counts: list[int] | None = None,
    chunks: ExpertChunks | None = None,
) -> torch.Tensor:
    """``grouped_mxfp4_matmul_reference`` from the dequantised activation ``a [M, K]`` (fp32).

    The active experts' weights are decoded together, a chunk at a time
    (``expert_chunks``; each weight exactly as ``dequantize_mxfp4_weight`` decodes
    it), then one matmul per expert writes its rows of the output: the same
    products and sums as decoding one expert at a time, in a few tensor ops per
    chunk instead of a dozen per expert.
    """
    e_total, n, half_k = w.shape
    k = 2 * half_k
    out = torch.empty(a.shape[0], n, dtype=torch.float32, device=a.device)
    if chunks is None:
        chunks = expert_chunks(offsets, counts, n * k, w.device)
    pairs, scales = _decode_tables(w.device)
    pair_words = pairs.view(torch.int64).view(256)
    w_bytes = w.view(torch.uint8).view(e_total, n * half_k)
    s_bytes = w_scale.view(torch.uint8).view(e_total, n * (k // BLOCK))
    for ids, ranges in chunks.chunks:
        m = len(ranges)
        codes = w_bytes.index_select(0, ids).view(-1).to(torch.int32)
        # Both values of a byte as one 8-byte word: a 1-D gather of words (bit copies)
        # is several times faster on the CPU than gathering rows of a [256, 2] table.
        tiles = pair_words.index_select(0, codes).view(torch.float32).view(m, n, k)
        s = scales.index_select(0, s_bytes.index_select(0, ids).view(-1).to(torch.int32))
        tiles.view(m, n, k // BLOCK, BLOCK).mul_(s.view(m, n, -1, 1))
        for j, (r0, r1) in enumerate(ranges):
            torch.mm(a[r0:r1], tiles[j].T, out=out[r0:r1])
    return out


def grouped_mxfp4_matmul_float64(
    x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """The float64 oracle from the unquantised rows ``x``.

    Quantise the activation, dequantise each expert's weight, multiply and sum in float64.
    """
    values, scales = quantize_act_fp8(x)
    _check(values, scales, offsets, w, w_scale)
    a = dequantize_act_fp8(values, scales).double()
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64, device=x.device)
    for e, r0, r1 in _active(offsets, None):
        weight = dequantize_mxfp4_weight(w[e], w_scale[e], torch.float64)
        out[r0:r1] = a[r0:r1] @ weight.T
    return out
