"""The compute dtype rule shared by every model module.

Activations may be bf16, fp16 or fp32; arithmetic that the spec wants in fp32
(norms, mHC, routing, softmax, projections) runs in ``compute_dtype``: fp32,
or float64 when the input already is float64. The float64 case exists for
tests: with 1e-16 rounding noise, two code paths (the dense reference and the
paged engine) agree to ~1e-12 even through FP4/FP8 rounding and top-k choices,
which amplify fp32's 1e-7 noise into occasional ~1e-3 jumps.
"""

from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def upcast(x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """``x`` in the compute dtype of ``(x, *others)``."""
    if not others:  # the common case, called hundreds of times a step: no generator
        if x.dtype is torch.float32 or x.dtype is torch.float64:
            return x
        return x.to(torch.float32)
    return x.to(compute_dtype(x, *others))
