"""Which implementation a public kernel op runs: the Triton kernel or the PyTorch reference.

``FLASHSERVE_KERNELS`` (read on every call, so tests can switch it):

- unset or ``auto``: Triton when every tensor argument is on CUDA and Triton
  is installed, else the reference (CPU mode always runs the references);
- ``reference``: always the reference;
- ``triton``: always Triton, on any device. On CPU tensors this only works
  under ``TRITON_INTERPRET=1`` (set before the Triton kernels are imported),
  which is how the tests hold each kernel to its reference without a GPU.

``FLASHSERVE_TRITON_OPS`` (a comma-separated list of op names, ``OPS``) narrows
Triton to those ops, the rest running their references: how a deviation on a
GPU is pinned on one kernel (``bench/gpu_smoke.py --attribute``).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

ENV_VAR = "FLASHSERVE_KERNELS"
OPS_VAR = "FLASHSERVE_TRITON_OPS"
MODES = ("auto", "reference", "triton")
# The ops that have a Triton kernel, by the name each call site gives.
OPS = (
    "fp8_linear",
    "moe_gemm",
    "store_kv",
    "gather_main_kv",
    "gather_index_keys",
    "sparse_attention",
    "indexer_scores",
    "block_max",
)


def kernel_mode() -> str:
    """The validated value of ``FLASHSERVE_KERNELS`` (``auto`` when unset)."""
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_ops() -> frozenset[str] | None:
    """The ops ``FLASHSERVE_TRITON_OPS`` allows Triton (None when unset: all)."""
    raw = os.environ.get(OPS_VAR, "").strip()
    if not raw:
        return None
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    if unknown := names - set(OPS):
        raise ValueError(f"{OPS_VAR}: unknown ops {sorted(unknown)}; known: {', '.join(OPS)}")
    return names


def use_triton(*tensors: torch.Tensor, op: str) -> bool:
    """True when ``op`` should run its Triton kernel on these tensors."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    allowed = triton_ops()
    if allowed is not None and op not in allowed:
        return False
    if mode == "triton":
        return True
    return triton_available() and all(t.is_cuda for t in tensors)
