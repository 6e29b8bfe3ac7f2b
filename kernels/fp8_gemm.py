"""Block-FP8 linear over packed weights: ``y = x W^T`` with W kept as the checkpoint's bytes.

docs/design/formats.md ("Activations before a packed GEMM"), docs/design/kernels.md.

``weight`` is E4M3 ``[N, K]`` with one E8M0 scale per 32 x 32 block (``scale
[ceil(N/32), ceil(K/32)]``, ragged edge blocks allowed); K must be a multiple of
32 (the activations are quantised per 32 along K). The arithmetic is the
release's: the activation is quantised to E4M3 per block of 32 with a
power-of-two scale (``kernels.act_quant``), multiplied by the weight, each K
block of 32 scaled by both sides' scales, accumulated in fp32, returned in
``x``'s dtype. Every product of two E4M3 values is exact in fp32, so paths
differ only in the order of the fp32 sums.

CUDA runs the Triton kernel (``kernels/triton/fp8_gemm.py``); the CPU path
dequantises the weight a tile of rows at a time into a reused scratch buffer.
``torch._scaled_mm`` is not used: its blockwise mode takes 1x128 / 128x128
scales (DeepSeek-V3's), not 32x32 weight blocks with 1x32 activation blocks.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from kernels.act_memo import quantize_act_shared
from kernels.act_quant import ACT_BLOCK, quantize_act_fp8
from kernels.dispatch import use_triton
from kernels.quant import e4m3_from_bytes, e8m0_decode

BLOCK = 32  # weight scale block, both ways

# Logical weight elements dequantised per CPU tile (a 16 MiB fp32 scratch). Every
# linear of the tiny and demo models is one tile; the release's largest dense
# projection (wq_b, 32768 x 1024) is eight.
TILE_ELEMENTS = 1 << 22

# Rows of x up to which the CPU path scales the activations per weight row block
# instead of the weight tile (a [N/32, T, K] product instead of a pass over N x K).
ACT_SIDE_ROWS = 16

# E4M3 byte -> fp16 bits: the 7 exponent/mantissa bits land in fp16's low exponent
# and top mantissa bits, giving value * 2^-8 (subnormals included); the sign comes
# from sign-extending the byte as int8 and clearing fp16's top exponent bit.
_FP16_SHIFT = 7
_FP16_MASK = ~0x4000  # as int16: -16385
_FP16_FACTOR = 256.0  # what the fp16 reading is short by
# E8M0 bytes >= this would overflow fp32 once multiplied by _FP16_FACTOR.
_FACTOR_SAFE_BELOW = 247


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    nan_free: bool | None = None,
    prepared: PreparedScales | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``x [..., K]`` times packed ``weight [N, K]`` transposed -> ``[..., N]``.

    ``scale``: ``float8_e8m0fnu`` or its ``uint8`` bytes. A float64 ``x`` (the
    engine's exact test mode) accumulates in float64 on the CPU path.
    ``nan_free``: the caller knows no weight byte is an E4M3 NaN (0x7F / 0xFF),
    so the CPU path may skip looking (None: it looks). ``prepared``: the CPU
    path's decoded scales (``prepare_scales``), which a module can keep.
    ``out_dtype``: the result's dtype (default ``x.dtype``; the accumulation is
    fp32 either way). The CPU path quantises ``x`` through ``kernels.act_memo``,
    so GEMMs that read the same tensor quantise it once.
    """
    _check(x, weight, scale)
    if use_triton(x, weight, scale, op="fp8_linear") and x.dtype != torch.float64:
        from kernels.triton.fp8_gemm import fp8_linear_triton

        if out_dtype is None or out_dtype == x.dtype:
            return fp8_linear_triton(x, weight, scale)
        return fp8_linear_triton(x.to(out_dtype), weight, scale)
    return fp8_linear_cpu(
        x, weight, scale, nan_free=nan_free, prepared=prepared, out_dtype=out_dtype
    )


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """The same arithmetic in float64: quantise x, dequantise W, accumulate (float64 out)."""
    _check(x, weight, scale)
    values, act_scales = quantize_act_fp8(x)
    xq = values.double() * act_scales.double().repeat_interleave(ACT_BLOCK, -1)
    n, k = weight.shape
    ws = e8m0_decode(_bytes(scale)).double()
    ws = ws.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    w = e4m3_from_bytes(weight).double() * ws
    return xq @ w.T


# ----------------------------------------------------------------- CPU path


@dataclass(frozen=True, slots=True)
class PreparedScales:
    """Weight-block scales decoded for the CPU path, in its compute dtype.

    ``folded``: they include the decode's factor 256 (false when that would
    overflow: scales of 2^120 and more; the tile then takes it)."""

    values: torch.Tensor  # [ceil(N/32), K/32]
    folded: bool
    per_row_block: torch.Tensor  # values [ceil(N/32), 1, K/32], as the act side broadcasts


def prepare_scales(scale: torch.Tensor, compute: torch.dtype) -> PreparedScales:
    scale_bytes = _bytes(scale)
    values = e8m0_decode(scale_bytes).to(compute)
    folded = bool(((scale_bytes < _FACTOR_SAFE_BELOW) | (scale_bytes == 0xFF)).all())
    values = values * _FP16_FACTOR if folded else values
    return PreparedScales(values, folded, values.unsqueeze(1))


def compute_dtype_of(x: torch.Tensor) -> torch.dtype:
    """The CPU path's accumulation dtype: float64 for float64 x, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@dataclass(frozen=True, slots=True)
class _TileViews:
    """The scratch buffers shaped for one tile of ``rows x k`` weights."""

    codes: torch.Tensor  # int16 [rows, k]
    codes_half: torch.Tensor  # the same bytes as float16
    tile: torch.Tensor  # compute dtype [rows, k]
    blocks_t: torch.Tensor | None  # tile as [rows / 32, k, 32] (rows a multiple of 32)


class _Scratch(threading.local):
    """One growing buffer per thread, dtype and device, reused by every call; the
    views of each tile shape are kept (a view costs about a microsecond per call)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.views: dict[tuple[int, int, torch.dtype, torch.device], _TileViews] = {}

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
            self.views.clear()  # views of the old buffer
        return buf if buf.numel() == numel else buf[:numel]

    def tile_views(
        self, rows: int, k: int, compute: torch.dtype, device: torch.device
    ) -> _TileViews:
        key = (rows, k, compute, device)
        views = self.views.get(key)
        if views is None:
            codes = self.get(rows * k, torch.int16, device).view(rows, k)
            tile = self.get(rows * k, compute, device).view(rows, k)
            blocks_t = None
            if rows % BLOCK == 0:
                blocks_t = tile.view(rows // BLOCK, BLOCK, k).transpose(1, 2)
            views = _TileViews(codes, codes.view(torch.float16), tile, blocks_t)
            self.views[key] = views
        return views


_SCRATCH = _Scratch()
_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _int16_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``2^_FP16_SHIFT`` and ``_FP16_MASK`` as 0-d int16 tensors: an integer op with a
    Python int wraps the scalar on every call, which costs more than the op."""
    pair = _CONSTANTS.get(device)
    if pair is None:
        shift = torch.tensor(1 << _FP16_SHIFT, dtype=torch.int16, device=device)
        mask = torch.tensor(_FP16_MASK, dtype=torch.int16, device=device)
        pair = _CONSTANTS[device] = (shift, mask)
    return pair


def tile_rows(n: int, k: int) -> int:
    """Weight rows dequantised at once: whole 32-row blocks, ``TILE_ELEMENTS`` at most."""
    return min(n, max(BLOCK, TILE_ELEMENTS // max(k, 1) // BLOCK * BLOCK))


def fp8_linear_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    *,
    nan_free: bool | None = None,
    prepared: PreparedScales | None = None,
    act: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The PyTorch path (any device): tiles of the weight dequantised into scratch.

    ``act``: ``x`` already quantised (``quantize_act_e4m3`` of its rows, float32
    values), e.g. once for every group of a grouped linear; default: through the memo.
    """
    compute = compute_dtype_of(x)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    n, k = weight.shape
    lead = x.shape[:-1]
    t = x.numel() // k if k else 0
    if t == 0 or n == 0:
        return torch.zeros(*lead, n, dtype=out_dtype, device=x.device)
    xq, act_scales = quantize_act_shared(x) if act is None else act
    if compute != torch.float32:  # exact: E4M3 values and powers of two
        xq, act_scales = xq.to(compute), act_scales.to(compute)
    # The decoded weight is short by _FP16_FACTOR: folded into the weight scales
    # unless that overflows, then into the tile.
    if prepared is None or prepared.values.dtype != compute:
        prepared = prepare_scales(scale, compute)
    w_scales, fold = prepared.values, prepared.folded  # [ceil(N/32), K/32]
    act_side = t <= ACT_SIDE_ROWS
    if not act_side:  # a fresh tensor: xq may be shared
        xq = (xq.view(t, k // ACT_BLOCK, ACT_BLOCK) * act_scales.unsqueeze(-1)).view(t, k)
    raw = weight.view(torch.int8) if weight.dtype != torch.int8 else weight
    rows = tile_rows(n, k)
    if rows == n:  # every linear of the tiny and demo models: one tile, no slicing
        views = _SCRATCH.tile_views(n, k, compute, x.device)
        if act_side and views.blocks_t is not None and fold:
            out = _one_tile_act_side(xq, act_scales, raw, views, prepared, nan_free)
        else:
            codes, tile = views.codes.view(-1), views.tile.view(-1)
            out = _tile_product(
                xq, act_scales, raw, codes, tile, w_scales, fold, nan_free, act_side
            )
    else:
        codes = _SCRATCH.get(rows * k, torch.int16, x.device)
        tile = _SCRATCH.get(rows * k, compute, x.device)
        pieces = []
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            size = (r1 - r0) * k
            s = w_scales[r0 // BLOCK : math.ceil(r1 / BLOCK)]
            pieces.append(
                _tile_product(
                    xq,
                    act_scales,
                    raw[r0:r1],
                    codes[:size],
                    tile[:size],
                    s,
                    fold,
                    nan_free,
                    act_side,
                )
            )
        out = torch.cat(pieces, dim=1)
    out = out.to(out_dtype)
    return out if len(lead) == 1 else out.reshape(*lead, n)


def _one_tile_act_side(
    xq: torch.Tensor,
    act_scales: torch.Tensor,
    raw: torch.Tensor,
    views: _TileViews,
    prepared: PreparedScales,
    nan_free: bool | None,
) -> torch.Tensor:
    """``_tile_product`` on the act side for a whole weight of full row blocks, folded
    scales: the same operations, through the kept views (the decode step's common case)."""
    assert views.blocks_t is not None
    t, k = xq.shape
    rows = views.tile.shape[0]
    views.codes.copy_(raw)  # sign-extends
    shift, mask = _int16_constants(raw.device)
    views.codes.mul_(shift).bitwise_and_(mask)
    views.tile.copy_(views.codes_half)
    if not nan_free:
        _mark_nans(raw, views.tile.view(-1))
    both = act_scales.unsqueeze(0) * prepared.per_row_block  # [row blocks, T, K/32]
    xs = (xq.view(1, t, k // BLOCK, BLOCK) * both.unsqueeze(-1)).view(-1, t, k)
    prod = torch.bmm(xs, views.blocks_t)  # [blocks, T, 32]
    return prod.view(t, rows) if t == 1 else prod.transpose(0, 1).reshape(t, rows)


def _tile_product(
    xq: torch.Tensor,
    act_scales: torch.Tensor,
    raw: torch.Tensor,
    codes: torch.Tensor,
    tile: torch.Tensor,
    s: torch.Tensor,
    fold: bool,
    nan_free: bool | None,
    act_side: bool,
) -> torch.Tensor:
    """``[T, rows]``: x times the weight rows ``raw`` (scales ``s``), decoded in ``tile``."""
    rows, k = raw.shape
    w = _decode(raw, codes, tile, nan_free).view(rows, k)
    if not fold:
        w.mul_(_FP16_FACTOR)
    if act_side:
        return _act_side(xq, act_scales, w, s)
    per_row = s.repeat_interleave(BLOCK, 0)[:rows]
    w.view(rows, k // BLOCK, BLOCK).mul_(per_row[:, :, None])
    return xq @ w.T


def _decode(
    raw: torch.Tensor, codes: torch.Tensor, tile: torch.Tensor, nan_free: bool | None
) -> torch.Tensor:
    """E4M3 bytes (int8 view) -> values / 256 in ``tile``, via fp16 bits in ``codes``."""
    codes.view(raw.shape).copy_(raw)  # sign-extends
    # A multiply by 2^7 is the shift (int16 wraps), and vectorises where shifts do not.
    shift, mask = _int16_constants(codes.device)
    codes.mul_(shift).bitwise_and_(mask)
    tile.copy_(codes.view(torch.float16))
    if not nan_free:
        _mark_nans(raw, tile)
    return tile


def _mark_nans(raw: torch.Tensor, tile: torch.Tensor) -> None:
    """NaN into the flat ``tile`` wherever the byte is an E4M3 NaN (the fp16 reading is finite)."""
    nan = (raw.reshape(-1).view(torch.uint8) & 0x7F) == 0x7F
    if bool(nan.any()):
        tile.masked_fill_(nan, math.nan)


def _act_side(
    xq: torch.Tensor, act_scales: torch.Tensor, w: torch.Tensor, s: torch.Tensor
) -> torch.Tensor:
    """``[T, rows]``: x scaled per (row block, K block) by both scales, times the raw tile.

    For a few rows of x this is cheaper than scaling the tile: ``[rows/32, T, K]``
    multiplications instead of ``rows x K``.
    """
    t, k = xq.shape
    rows = w.shape[0]
    full = rows // BLOCK * BLOCK
    kb = k // BLOCK
    both = act_scales.unsqueeze(0) * s.unsqueeze(1)  # [row blocks, T, K/32]
    xs = (xq.view(1, t, kb, BLOCK) * both.unsqueeze(-1)).view(-1, t, k)
    if full == rows:  # no ragged block of rows
        prod = torch.bmm(xs, w.view(rows // BLOCK, BLOCK, k).transpose(1, 2))  # [blocks, T, 32]
        return prod.view(t, rows) if t == 1 else prod.transpose(0, 1).reshape(t, rows)
    parts = []
    if full:
        wb = w[:full].view(full // BLOCK, BLOCK, k)
        prod = torch.bmm(xs[: full // BLOCK], wb.transpose(1, 2))
        parts.append(prod.view(t, full) if t == 1 else prod.transpose(0, 1).reshape(t, full))
    parts.append(xs[-1] @ w[full:].T)  # the ragged last block of rows
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


# ----------------------------------------------------------------- shared


def _bytes(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"fp8_linear: scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
    return scale


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype not in (torch.float8_e4m3fn, torch.uint8, torch.int8):
        raise TypeError(
            f"fp8_linear: weight must be a 2-D float8_e4m3fn [N, K], got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, weight {tuple(weight.shape)}")
    if k % ACT_BLOCK:
        raise ValueError(f"fp8_linear: K = {k} is not a multiple of {ACT_BLOCK}")
    want = (math.ceil(n / BLOCK), math.ceil(k / BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8_linear: scale {tuple(scale.shape)}, want {want}")
    if scale.dtype != torch.float8_e8m0fnu and scale.dtype != torch.uint8:
        _bytes(scale)  # raises
