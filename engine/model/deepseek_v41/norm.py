"""RMSNorm, the only normalisation V4.1 uses: eps 1e-20 everywhere.

See docs/design/architecture.md §1.1.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.precision import upcast


class RMSNorm(nn.Module):
    """``y = x * rsqrt(mean(x^2) + eps) * weight`` over the last dim.

    Checkpoint name: ``<prefix>.weight``. The normalisation runs in fp32 and is
    rounded to the input dtype before the weight multiplies it, in that dtype:
    the release's rounding points under bf16 (an fp32 caller stays in fp32).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = upcast(x)
        inv_rms = torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (x32 * inv_rms).to(x.dtype) * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
