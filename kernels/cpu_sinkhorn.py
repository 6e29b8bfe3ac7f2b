"""The Sinkhorn passes of mHC as one C call on CPU, bit-identical to the eager passes.

A decode step runs the Sinkhorn normalisation twice per layer on ``[T, hc, hc]``
matrices (hc = 4): 39 passes of (sum, add eps, divide), about 117 tiny tensor
operations whose cost is the per-operation dispatch, not the arithmetic. This
module compiles a 30-line C loop doing the same float operations in the same
order (each sum ``((x0 + x1) + x2) + x3``, as PyTorch's CPU reduction adds four
elements; ``+ eps``; an IEEE division) into one call.

The C code is compiled once per machine with the system C compiler into
``$FLASHSERVE_CACHE_DIR`` (default ``~/.cache/flashserve``) and loaded with
``ctypes``; no compiler, a failed build, or ``FLASHSERVE_CPU_KERNELS=0`` leave
the caller on its eager passes. Because PyTorch's reduction order depends on
the CPU's vector width and the matrix size, the library is only used for a
dtype after a self-check on this machine found it bitwise equal to the eager
passes (``_self_check``); the tests hold it to the same.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

ENV_VAR = "FLASHSERVE_CPU_KERNELS"

# Rows then columns, as the eager passes: the sums run over the matrix's own
# index order, starting from the first element (PyTorch's partial sums start at
# 0, and 0 + x is x), then add eps in a separate rounding, then divide.
_SOURCE = r"""
#define PASSES(T, NAME)                                                        \
void NAME(T *c, long n, long hc, long iters, T eps) {                          \
    T sums[64];                                                                \
    long sq = hc * hc;                                                         \
    for (long m = 0; m < n; ++m) {                                             \
        T *a = c + m * sq;                                                     \
        for (long k = 0; k < sq; ++k) a[k] = a[k] + eps;                       \
        for (long it = 0; it < iters; ++it) {                                  \
            if (it > 0) {                                                      \
                for (long i = 0; i < hc; ++i) {                                \
                    T s = a[i * hc];                                           \
                    for (long j = 1; j < hc; ++j) s = s + a[i * hc + j];       \
                    sums[i] = s + eps;                                         \
                }                                                              \
                for (long i = 0; i < hc; ++i)                                  \
                    for (long j = 0; j < hc; ++j)                              \
                        a[i * hc + j] = a[i * hc + j] / sums[i];               \
            }                                                                  \
            for (long j = 0; j < hc; ++j) {                                    \
                T s = a[j];                                                    \
                for (long i = 1; i < hc; ++i) s = s + a[i * hc + j];           \
                sums[j] = s + eps;                                             \
            }                                                                  \
            for (long i = 0; i < hc; ++i)                                      \
                for (long j = 0; j < hc; ++j)                                  \
                    a[i * hc + j] = a[i * hc + j] / sums[j];                   \
        }                                                                      \
    }                                                                          \
}
PASSES(float, fs_sinkhorn_f32)
PASSES(double, fs_sinkhorn_f64)
"""

# Sizes the C loop's order is known to match PyTorch's four-accumulator reduction
# (at most 4 elements: one per accumulator, combined in order); larger hc stays eager.
MAX_HC = 4


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


def _cache_dir() -> Path:
    root = os.environ.get("FLASHSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "flashserve"
    )
    return Path(root) / "cpu_kernels"


def _build() -> ctypes.CDLL | None:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    # -ffp-contract=off and no fast-math: every + and / rounds on its own, as eager does.
    flags = ["-O2", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off"]
    key = hashlib.sha256((_SOURCE + " ".join(flags) + compiler).encode()).hexdigest()[:16]
    target = _cache_dir() / f"sinkhorn_{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "sinkhorn.c"
                src.write_text(_SOURCE)
                out = Path(tmp) / "sinkhorn.so"
                subprocess.run(
                    [compiler, *flags, "-o", str(out), str(src)],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(out, target)  # atomic: concurrent builders each write their own
        except (OSError, subprocess.SubprocessError):
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError:
        return None
    for name, ctype in (("fs_sinkhorn_f32", ctypes.c_float), ("fs_sinkhorn_f64", ctypes.c_double)):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctype]
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    return _build()


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
    lib = _library()
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
    return enabled() and _self_check(c.dtype, hc)


def passes_(c: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``eager_passes`` in one C call (check ``usable(c)`` first); in place, returns ``c``."""
    lib = _library()
    assert lib is not None
    _run(lib, c, iters, eps)
    return c
