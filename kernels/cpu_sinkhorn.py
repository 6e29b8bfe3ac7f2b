"""The Sinkhorn passes of mHC as one C call on CPU, bit-identical to the eager passes.

A decode step runs the Sinkhorn normalisation twice per layer on ``[T, hc, hc]``
matrices (hc = 4): 39 passes of (sum, add eps, divide), about 117 tiny tensor
operations whose cost is the per-operation dispatch, not the arithmetic. This
module runs a C loop (``kernels.cpu_native``) doing the same float operations
in the same order (each sum ``((x0 + x1) + x2) + x3``, as PyTorch's CPU reduction
adds four elements; ``+ eps``; an IEEE division) in one call; without the library
(no compiler, ``FLASHSERVE_CPU_KERNELS=0``) the caller keeps its eager passes.
Because PyTorch's reduction order depends on the CPU's vector width and the
matrix size, the library is only used for a dtype after a self-check on this
machine found it bitwise equal to the eager passes (``_self_check``); the tests
hold it to the same.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels import cpu_native

ENV_VAR = cpu_native.ENV_VAR

# Sizes the C loop's order is known to match PyTorch's four-accumulator reduction
# (at most 4 elements: one per accumulator, combined in order); larger hc stays eager.
MAX_HC = 4


def _run(lib: ctypes.CDLL, c: torch.Tensor, iters: int, eps: float) -> None:
    fn = lib.fs_sinkhorn_f32 if c.dtype is torch.float32 else lib.fs_sinkhorn_f64
    hc = c.shape[-1]
    # iters <= 1 is the single column pass, as in the eager loop.
    fn(c.data_ptr(), c.numel() // (hc * hc), hc, max(iters, 1), eps)


def eager_passes(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The eager passes on ``c = softmax(logits)`` in place: the order the C loop copies."""
    c.add_(eps)
    cols = c.sum(dim=-2, keepdim=True)
    c.div_(cols.add_(eps))
    rows = torch.empty_like(c[..., :1])
    for _ in range(iters - 1):
        c.div_(torch.sum(c, dim=-1, keepdim=True, out=rows).add_(eps))
        c.div_(torch.sum(c, dim=-2, keepdim=True, out=cols).add_(eps))
    return c


@functools.cache
def _self_check(dtype: torch.dtype, hc: int) -> bool:
    """The C loop equals the eager passes bit for bit on this machine (random inputs,
    several batch shapes); otherwise that dtype and size stay eager."""
    lib = cpu_native.library()
    if lib is None:
        return False
    gen = torch.Generator().manual_seed(1234)
    for rows in (1, 3, 8, 33):
        for scale in (1.0, 8.0):
            c = torch.softmax(torch.randn(rows, hc, hc, generator=gen, dtype=dtype) * scale, -1)
            for eps, iters in ((1e-6, 20), (1e-2, 3), (1e-6, 1)):
                want = eager_passes(c.clone(), iters, eps)
                got = c.clone()
                _run(lib, got, iters, eps)
                if not torch.equal(got, want):
                    return False
    return True


def usable(c: torch.Tensor) -> bool:
    """True when ``passes_`` may run on ``c``: contiguous CPU float32/64 ``[..., hc, hc]``."""
    if c.device.type != "cpu" or c.dtype not in (torch.float32, torch.float64):
        return False
    hc = c.shape[-1]
    if c.dim() < 2 or c.shape[-2] != hc or hc > MAX_HC or not c.is_contiguous():
        return False
    return cpu_native.enabled() and _self_check(c.dtype, hc)


def passes_(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``eager_passes`` in one C call (check ``usable(c)`` first); in place, returns ``c``."""
    lib = cpu_native.library()
    assert lib is not None
    _run(lib, c, iters, eps)
    return c
