"""A few CPU loops in C, compiled once per machine and called through ``ctypes``.

On CPU a decode step's cost is mostly per-operation dispatch (the decode-step
profiles in docs/benchmarks/history.md): tiny tensor operations repeated in
Python loops. The loops here do the same
arithmetic as the eager code they replace, in the same order, in one call:

- ``fs_sinkhorn_f32/f64``: mHC's Sinkhorn passes (``kernels.cpu_sinkhorn``);
- ``fs_index_keys_f32``: every MXFP4 index key of a list of pages, decoded by
  copying entries of the (scale byte, data byte) product table the eager decode
  gathers from (``kernels.kv_formats.dequantize_index_key_parts``): bit copies,
  no arithmetic, so equal by construction.

The source is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``)
into ``cpu_kernels/`` of the cache directory (``$FLASHSERVE_CACHE``, else
``$XDG_CACHE_HOME/flashserve``, else ``~/.cache/flashserve``), keyed by a hash
of the source and flags. No compiler, a failed build, or ``FLASHSERVE_CPU_KERNELS=0``
(read on every call) leave every caller on its eager code.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

ENV_VAR = "FLASHSERVE_CPU_KERNELS"

# Sinkhorn, rows then columns as the eager passes: each sum runs over the matrix's
# own index order from its first element (PyTorch's partial sums start at 0, and
# 0 + x is x), then adds eps in a separate rounding, then divides.
_SOURCE = r"""
#include <stdint.h>
#include <string.h>

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

/* Index keys of pages[0..n_pages): key e of page p is data[p*page_stride + e*64 ..]
   (64 bytes: 4 blocks x 16 bytes of FP4 pairs) and scales[p*page_stride_s + e*4 ..]
   (4 E8M0 bytes). table: uint64 [256 * 256], entry (scale << 8 | byte) = the two
   scaled float32 values of that byte. out: float32 [n_pages, E, 128]. */
void fs_index_keys_f32(const uint8_t *data, long page_stride, const uint8_t *scales,
                       long page_stride_s, const int64_t *pages, long n_pages, long E,
                       const uint64_t *table, uint64_t *out) {
    for (long p = 0; p < n_pages; ++p) {
        const uint8_t *dp = data + pages[p] * page_stride;
        const uint8_t *sp = scales + pages[p] * page_stride_s;
        for (long e = 0; e < E; ++e) {
            const uint8_t *d = dp + e * 64;
            const uint8_t *s = sp + e * 4;
            uint64_t *o = out + (p * E + e) * 64;
            for (long b = 0; b < 4; ++b) {
                const uint64_t *row = table + ((uint64_t)s[b] << 8);
                for (long i = 0; i < 16; ++i) o[b * 16 + i] = row[d[b * 16 + i]];
            }
        }
    }
}
"""


_SUSPENDED = threading.local()


def enabled() -> bool:
    if getattr(_SUSPENDED, "depth", 0):
        return False
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No C calls inside (this thread): the eager tensor ops run instead. A graph capture
    records tensor operations; a C call on raw pointers would be missing from it, so a
    captured piece must not make one (engine/runner/cuda_graphs.py)."""
    _SUSPENDED.depth = getattr(_SUSPENDED, "depth", 0) + 1
    try:
        yield
    finally:
        _SUSPENDED.depth -= 1


def _cache_dir() -> Path:
    # The serve command's cache convention (flashserve/serve_cmd.py), not imported:
    # kernels stay below the server in the layering.
    if os.environ.get("FLASHSERVE_CACHE"):
        root = Path(os.environ["FLASHSERVE_CACHE"])
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]) / "flashserve"
    else:
        root = Path.home() / ".cache" / "flashserve"
    return root / "cpu_kernels"


def build() -> ctypes.CDLL | None:
    """Compile (or reuse) and load the library; None when that is not possible."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    # -ffp-contract=off and no fast-math: every + and / rounds on its own, as eager does.
    flags = ["-O2", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off"]
    key = hashlib.sha256((_SOURCE + " ".join(flags) + compiler).encode()).hexdigest()[:16]
    target = _cache_dir() / f"flashserve_cpu_{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "cpu_kernels.c"
                src.write_text(_SOURCE)
                out = Path(tmp) / "cpu_kernels.so"
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
    c_long, c_void = ctypes.c_long, ctypes.c_void_p
    for name, ctype in (("fs_sinkhorn_f32", ctypes.c_float), ("fs_sinkhorn_f64", ctypes.c_double)):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [c_void, c_long, c_long, c_long, ctype]
    lib.fs_index_keys_f32.restype = None
    lib.fs_index_keys_f32.argtypes = [
        c_void,
        c_long,
        c_void,
        c_long,
        c_void,
        c_long,
        c_long,
        c_void,
        c_void,
    ]
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library (built on first use), or None."""
    return build()


def available() -> bool:
    """The library may be used now: enabled and built."""
    return enabled() and library() is not None
