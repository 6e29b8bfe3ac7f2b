"""Dense MQA with a per-head attention sink: the oracle for the sparse kernels."""

from __future__ import annotations

import torch

from engine.model.precision import upcast


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``o[t, h] = sum_s p[t, h, s] k[s]`` with K = V (docs/design/architecture.md §1.4).

    q [T, H, d], k [S, d], mask [T, S] (True = key s is visible to query t),
    sink [H]. ``p`` is the softmax over the allowed logits ``q.k * scale`` plus
    one extra logit ``sink[h]`` whose column is then dropped, so the weights
    sum to less than one. A query with no allowed key sees only the sink and
    gets zeros. ``sink`` must be finite. fp32 inside; returns q's dtype.
    """
    assert q.dim() == 3 and k.dim() == 2 and q.shape[-1] == k.shape[-1], (q.shape, k.shape)
    assert mask.shape == (q.shape[0], k.shape[0]), (mask.shape, q.shape, k.shape)
    k32 = upcast(k)
    logits = torch.einsum("thd,sd->ths", upcast(q), k32) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_col = upcast(sink)[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat((logits, sink_col), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("ths,sd->thd", probs, k32).to(q.dtype)
