"""Expert-parallel dispatch and combine: a MoE layer's two all-to-alls under DP attention.

See docs/design/parallelism.md ("EP dispatch"). When the EP ranks hold different
rows (``Parallel.ep_dispatch``), each rank sorts its (token, slot) pairs by
expert, which sorts them by owning rank too (``expert_range`` gives each rank a
contiguous block), and

1. exchanges the pair counts (one all-to-all of W int64s: the splits);
2. sends each pair's row, expert id and routing weight to the expert's owner
   (the dispatch: one all-to-all of bytes, the row and its 2 numbers packed);
3. the owner computes its experts' outputs of the pairs it received
   (``RoutedExperts.per_pair``) and sends them back with the reverse splits
   (the combine);
4. the source sums each token's outputs with the ``index_add_`` one process
   runs, over the pairs in the same (expert-sorted, stable) order, so the sum
   is the single process's to the bit wherever the per-pair outputs are.

Every EP rank enters both all-to-alls in every MoE layer, with rows or without
(``DeepseekV41.idle_layers``): the other ranks' pairs may need its experts.
The same code runs on NCCL and gloo (torch's gloo has ``all_to_all_single``).
"""

from __future__ import annotations

import torch

from engine.model.deepseek_v41.routed_experts import RoutedExperts
from engine.model.parallel import Parallel, expert_range
from engine.model.precision import compute_dtype, upcast


def _pack(rows: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """``rows [P, D]`` and ``meta [P, 2]`` as one ``uint8 [P, bytes]`` message (bit-exact)."""
    return torch.cat([rows.contiguous().view(torch.uint8), meta.contiguous().view(torch.uint8)], 1)


def _unpack(
    message: torch.Tensor, row_dtype: torch.dtype, meta_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``_pack`` given both dtypes (every rank's are the same)."""
    meta_bytes = 2 * torch.empty(0, dtype=meta_dtype).element_size()
    split = message.shape[1] - meta_bytes
    rows = message[:, :split].contiguous().view(row_dtype)
    return rows, message[:, split:].contiguous().view(meta_dtype)


def ep_moe(
    experts: RoutedExperts,
    parallel: Parallel,
    x: torch.Tensor,
    weights: torch.Tensor,
    idx: torch.Tensor,
) -> torch.Tensor:
    """``sum_k weights[t, k] * E_{idx[t, k]}(x[t])`` for this rank's rows ``x [T, D]``, in
    the compute dtype, with the experts spread over the EP ranks (``T`` may be 0)."""
    p, k = parallel, idx.shape[-1]
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)  # group_by_expert's order in one process
    expert = flat[order]
    token = order // k
    starts = [expert_range(experts.total, r, p.ep_size)[0] for r in range(p.ep_size)]
    bounds = torch.tensor([*starts, experts.total], dtype=expert.dtype, device=expert.device)
    send = torch.diff(torch.searchsorted(expert, bounds))  # pairs per owning rank
    recv = p.ep_all_to_all(send)
    send_splits, recv_splits = torch.stack([send, recv]).tolist()  # one host sync

    w = weights.flatten()[order]
    message = _pack(x[token], torch.stack([expert.to(w.dtype), w], -1))  # ids exact in fp32
    rows, meta = _unpack(p.ep_all_to_all(message, send_splits, recv_splits), x.dtype, w.dtype)
    local = meta[:, 0].long() - experts.first
    out = experts.per_pair(rows, meta[:, 1:], local)  # the pairs routed to our experts
    back = p.ep_all_to_all(out, recv_splits, send_splits)  # our pairs' outputs, in `order`

    y = torch.zeros(x.shape, dtype=compute_dtype(x), device=x.device)
    return y.index_add_(0, token, upcast(back, y))
