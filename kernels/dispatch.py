"""Which implementation a public kernel op runs: the Triton kernel or the PyTorch reference.

``FLASHSERVE_KERNELS`` (read on every call, so tests can switch it):

- unset or ``auto``: Triton when every tensor argument is on CUDA and Triton
  is installed, else the reference (CPU mode always runs the references);
- ``reference``: always the reference;
- ``triton``: always Triton, on any device. On CPU tensors this only works
  under ``TRITON_INTERPRET=1`` (set before the Triton kernels are imported),
  which is how the tests hold each kernel to its reference without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

ENV_VAR = "FLASHSERVE_KERNELS"
MODES = ("auto", "reference", "triton")


def kernel_mode() -> str:
    """The validated value of ``FLASHSERVE_KERNELS`` (``auto`` when unset)."""
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the op should run its Triton kernel on these tensors."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        return True
    return triton_available() and all(t.is_cuda for t in tensors)
