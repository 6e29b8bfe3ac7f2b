"""A rank's place in tensor and expert parallelism, and the collectives the model calls.

See docs/design/parallelism.md. ``SINGLE`` (one process) makes every collective
the identity, so the model code reads the same with and without parallelism.

* **TP** (``tp_size`` T ranks, the same rows on each): query heads, ``wo_a``
  groups, ``wo_b``'s input and the shared expert's intermediate dim are split
  (``TP_SPLIT``); one all-reduce after ``wo_b``, one after the MoE.
* **EP** (``ep_size`` W ranks): each rank holds experts ``expert_range``, the
  router is replicated. When the EP ranks hold the same rows (EP over the TP
  group) each computes its experts' share of every row and the shares are
  summed with the TP all-reduce. When they hold different rows (``ep_dispatch``:
  DP attention) each (row, slot) pair goes to its expert's rank and its output
  comes back: two all-to-alls per MoE layer, on NCCL and gloo alike
  (engine/model/ep_dispatch.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

# What tensor parallelism splits, and along which dimension (0: output rows, 1: input
# columns). Everything else is replicated on every rank of a TP group. The memory
# plan (engine/planning/memory_plan.py) and the loader (engine/loader/checkpoint.py) read this rule.
TP_SPLIT: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"\.attn\.wq_b\.weight$"), 0),  # query heads
    (re.compile(r"\.attn\.attn_sink$"), 0),  # one sink per query head
    (re.compile(r"\.attn\.wo_a\.weight$"), 0),  # the o_groups groups
    (re.compile(r"\.attn\.wo_b\.weight$"), 1),  # its input is the groups' output
    (re.compile(r"\.ffn\.shared_experts\.w[13]\.weight$"), 0),  # shared intermediate
    (re.compile(r"\.ffn\.shared_experts\.w2\.weight$"), 1),
)

_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")


def tp_split_dim(name: str) -> int | None:
    """The dimension TP splits tensor ``name`` along, or None when it is replicated."""
    for pattern, dim in TP_SPLIT:
        if pattern.search(name):
            return dim
    return None


def expert_of(name: str) -> int | None:
    """The routed expert a checkpoint tensor belongs to (``layers.L.ffn.experts.E.*``)."""
    match = _EXPERT.search(name)
    return int(match.group(1)) if match else None


def expert_range(n_experts: int, ep_rank: int, ep_size: int) -> tuple[int, int]:
    """``[first, stop)`` of rank ``ep_rank``: E / W each, the first ``E mod W`` one more
    (the memory plan's rule)."""
    base, extra = divmod(n_experts, ep_size)
    first = ep_rank * base + min(ep_rank, extra)
    return first, first + base + (ep_rank < extra)


@dataclass(frozen=True)
class Parallel:
    """This rank's TP and EP coordinates and groups (None: the default group).

    ``ep_dispatch``: the EP ranks run different rows (DP attention), so a MoE
    layer dispatches its pairs to their experts' ranks; False when every EP rank
    runs the same rows.
    """

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    ep_dispatch: bool = False

    def __post_init__(self) -> None:
        coords = (("tp", self.tp_rank, self.tp_size), ("ep", self.ep_rank, self.ep_size))
        for what, rank, size in coords:
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{what} rank {rank} of size {size}")
        if self.ep_dispatch and self.ep_size == 1:
            raise ValueError("ep_dispatch needs ep_size > 1")
        if self.ep_dispatch and self.tp_size > 1 and self.same_group:
            raise ValueError("the ranks of one TP group run the same rows: no dispatch")

    @property
    def same_group(self) -> bool:
        """TP and EP run over the same ranks (TP x EP on one group)."""
        return self.tp_size == self.ep_size and self.tp_group is self.ep_group

    # ------------------------------------------------------------ shapes
    def tp_part(self, n: int, what: str) -> int:
        """This rank's share of ``n`` (heads, groups, intermediate columns)."""
        if n % self.tp_size:
            raise ValueError(f"{what} = {n} is not divisible by the TP size {self.tp_size}")
        return n // self.tp_size

    def experts(self, n_experts: int) -> tuple[int, int]:
        """``[first, stop)`` of the routed experts this rank holds."""
        return expert_range(n_experts, self.ep_rank, self.ep_size)

    # ------------------------------------------------------------ collectives
    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the TP ranks' partial ``x`` (in place); the identity on one rank."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def ep_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1:
            dist.all_reduce(x, group=self.ep_group)
        return x

    def ep_all_to_all(
        self, x: torch.Tensor, send: list[int] | None = None, recv: list[int] | None = None
    ) -> torch.Tensor:
        """``x``'s rows scattered over the EP ranks, ``send[r]`` (consecutive) to rank r,
        and the rows received, ``recv[r]`` from rank r, in rank order. None: equal splits.

        Every EP rank must call it, also with no rows to send or receive.
        """
        shape = x.shape if recv is None else (sum(recv), *x.shape[1:])
        out = x.new_empty(shape)
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.ep_group)
        return out


SINGLE = Parallel()


def world_parallel(tensor_parallel_size: int = 1, expert_parallel: bool = False) -> Parallel:
    """This process's ``Parallel`` in the initialised default group.

    TP groups are ``tensor_parallel_size`` consecutive ranks (the memory plan's
    rank order, ``rank = dp_rank * T + tp_rank``); EP, when on, spans every rank
    (W = T x D), so with D > 1 the EP ranks hold different rows and dispatch.
    Every rank must call this (``new_group`` is collective).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    t = tensor_parallel_size
    if t < 1 or world % t:
        raise ValueError(f"tensor_parallel_size {t} does not divide the world size {world}")
    dp = world // t
    tp_group: dist.ProcessGroup | None = None
    if dp > 1 and t > 1:
        for d in range(dp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(d * t, (d + 1) * t)))
            if d == rank // t:
                tp_group = group
    ep = world if expert_parallel else 1
    return Parallel(
        tp_rank=rank % t,
        tp_size=t,
        ep_rank=rank if expert_parallel else 0,
        ep_size=ep,
        tp_group=tp_group,
        ep_group=None,
        ep_dispatch=expert_parallel and dp > 1,
    )
