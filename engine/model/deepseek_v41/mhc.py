"""Manifold-constrained hyper-connections (mHC), V4.1 single-pass variant.

See docs/design/architecture.md §1.3.

The residual stream is ``R [T, hc, D]``: ``hc`` copies of the hidden state.
Each sublayer owns parameters ``fn [(2+hc)*hc, hc*D]``, ``base [(2+hc)*hc]`` and
``scale [3]`` (they live on the layer); these pure functions turn them into
the three mixing coefficients and apply them. All coefficients are fp32.
"""

from __future__ import annotations

import torch

from engine.model.precision import upcast
from kernels import cpu_sinkhorn

# post = POST_GAIN * sigmoid(...): lets a sublayer write up to twice its output.
POST_GAIN = 2.0


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Near doubly-stochastic ``C`` from ``logits [..., hc, hc]`` (fp32).

    ``C = softmax(logits, -1) + eps``; one column pass; then ``iters - 1``
    rounds of (row pass, column pass). Every pass divides by ``sum + eps``.
    So ``iters = 20`` makes 1 + 2 * 19 = 39 passes, ending on a column pass:
    columns sum to 1 (up to eps), rows only approximately.
    """
    if torch.is_grad_enabled() and logits.requires_grad:  # training: autograd needs copies
        c = torch.softmax(upcast(logits), dim=-1) + eps
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(dim=-1, keepdim=True) + eps)
            c = c / (c.sum(dim=-2, keepdim=True) + eps)
        return c
    c = torch.softmax(upcast(logits), dim=-1)
    # Serving: the 39 passes in place, in one C call on CPU (cpu_sinkhorn: the same
    # float operations in the same order, checked bit for bit on this machine), else
    # as eager tensor passes into two small sum buffers. Either way the arithmetic
    # of ``c = c / (c.sum(dim) + eps)`` per pass; the cost is per operation.
    if cpu_sinkhorn.usable(c):
        return cpu_sinkhorn.passes_(c, iters, eps)
    return cpu_sinkhorn.eager_passes(c, iters, eps)


def hc_coefficients(
    R: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    hc_eps: float,
    sinkhorn_iters: int,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(pre [T, hc], post [T, hc], comb [T, hc, hc])`` of one sublayer, all fp32.

    ``m = (flat(R) * rsqrt(mean(flat(R)^2) + norm_eps)) @ fn^T``, then
    ``pre = sigmoid(m_pre * scale0 + base_pre) + hc_eps`` (not renormalised),
    ``post = 2 sigmoid(m_post * scale1 + base_post)``,
    ``comb = sinkhorn(m_comb * scale2 + base_comb)`` with ``comb[i, j]`` the
    weight of input copy ``i`` in output copy ``j``.
    """
    hc = R.shape[-2]
    flat = upcast(R.flatten(-2))
    # Normalise, then project: the release's order (the same value as scaling the
    # projection, rounded as the release rounds it).
    flat = flat * torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + norm_eps)
    m = flat @ upcast(fn).T
    base, scale = upcast(base), upcast(scale)
    m_pre, m_post, m_comb = m.split([hc, hc, hc * hc], dim=-1)
    b_pre, b_post, b_comb = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(m_pre * scale[0] + b_pre) + hc_eps
    post = POST_GAIN * torch.sigmoid(m_post * scale[1] + b_post)
    comb_logits = (m_comb * scale[2] + b_comb).unflatten(-1, (hc, hc))
    comb = sinkhorn(comb_logits, sinkhorn_iters, hc_eps)
    return pre, post, comb


def hc_initial_pre(T: int, hc: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``pre`` of the very first collapse: one-hot on copy 0 (``[T, hc]`` fp32).

    V4.1 collapses each sublayer input with the *previous* sublayer's ``pre``;
    before layer 0 there is none, and all copies still equal the embedding,
    so the first attention input is copy 0.
    """
    pre = torch.zeros(T, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre


def hc_collapse(R: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_i pre[i] R[i]``: ``[T, hc, D] -> [T, D]``, in fp32, returned in ``R``'s dtype."""
    return (upcast(pre).unsqueeze(-1) * upcast(R)).sum(dim=-2).to(R.dtype)


def hc_mix(
    R: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``R'[j] = sum_i comb[i, j] R[i] + post[j] y``, in fp32, returned in ``R``'s dtype."""
    carried = torch.einsum("...ij,...id->...jd", upcast(comb), upcast(R))
    written = upcast(post).unsqueeze(-1) * upcast(y).unsqueeze(-2)
    return (carried + written).to(R.dtype)
