"""Block max of a score matrix: ``out[t, b] = max(scores[t, b*bs : (b+1)*bs])``, -inf padded."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_max_kernel(
    s_ptr,
    s_st,
    out_ptr,
    out_st,
    n_cols,
    n_blocks,
    block_size,
    BLOCK_B: tl.constexpr,
    WIDTH: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    blocks = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    within = tl.arange(0, WIDTH)
    cols = blocks[:, None] * block_size + within[None, :]
    mask = (within[None, :] < block_size) & (cols < n_cols)
    x = tl.load(s_ptr + t * s_st + cols, mask=mask, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 1)
    tl.store(
        out_ptr + t * out_st + blocks, best.to(out_ptr.dtype.element_ty), mask=blocks < n_blocks
    )


def block_max_triton(
    scores: torch.Tensor, block_size: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton ``block_max`` (same contract); ``out`` ([T, n_blocks], same dtype) may be given."""
    t, s = scores.shape
    n_blocks = triton.cdiv(s, block_size)
    if out is None:
        out = torch.empty(t, n_blocks, dtype=scores.dtype, device=scores.device)
    assert out.shape == (t, n_blocks) and out.dtype == scores.dtype and out.stride(1) == 1
    if t == 0 or n_blocks == 0:
        return out
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    width = triton.next_power_of_2(block_size)
    block_b = max(1, 1024 // width)
    _block_max_kernel[(t, triton.cdiv(n_blocks, block_b))](
        scores,
        scores.stride(0),
        out,
        out.stride(0),
        s,
        n_blocks,
        block_size,
        BLOCK_B=block_b,
        WIDTH=width,
        enable_fp_fusion=False,
    )
    return out
