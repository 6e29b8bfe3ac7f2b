"""Bytes an expert-parallel MoE layer moves per token, on paper (docs/BENCHMARKS.md).

Per MoE layer a token's hidden row goes to the ranks owning its top-k routed
experts (dispatch) and their outputs come back (combine). With E experts split
evenly over W ranks (E / W each) and routing spread evenly over the experts (the
load-balancing bias aims at it), a chosen expert is on the token's own rank with
probability 1 / W, so a token sends

    remote copies = k * (1 - 1/W)

rows each way. Dispatch row: ``H`` bytes of E4M3 plus ``H / 32`` UE8M0 scales
(the release quantises an expert's input that way anyway, kernels/act_quant.py),
or ``2 H`` in bf16; combine row: ``2 H`` (bf16). A dispatcher that sends a
token once per destination rank (and a combine that sums a rank's experts
before sending back) moves one row per distinct remote rank instead:

    remote ranks = (W - 1) * (1 - C(E - E/W, k) / C(E, k))

(the k experts are distinct, so a given other rank gets none of them with
probability C(E - E/W, k) / C(E, k)). Across ``nnodes`` nodes of W / nnodes
ranks, ``k * (1 - 1/nnodes)`` copies leave the node. Expert ids and routing
weights (8 B per copy) are left out: under 0.2 % of a row.

What engine/model/ep_dispatch.py sends today (``sent_bytes``): one copy per
remote pair each way, the dispatch as the bf16 row plus its fp32 expert id
and weight (``2 H + 8``), the combine as the packed experts' fp32 output
(``4 H``), unrounded so that the source's sum is one process's:

    sent = k (1 - 1/W) (6 H + 8)

The all-gather it replaced (``gather_bytes``, ring collectives) sent each of a
rank's rows and its routing (``2 H + 8 k``) to the W - 1 others and then
all-reduced the fp32 partial outputs of all W ranks' rows (``2 (W - 1) / W``
of them per rank): per token of the rank, ``(W - 1) (10 H + 8 k)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from engine.model.deepseek_v41.config import ModelConfig

SCALE_BLOCK = 32  # one UE8M0 scale per 32 E4M3 values (the release's act_quant)


@dataclass(frozen=True, slots=True)
class EPTraffic:
    """Per token per MoE layer, bytes one rank sends for dispatch and for combine."""

    world: int
    nnodes: int
    experts_per_rank: float
    top_k: int
    local_fraction: float  # of the k chosen experts, the share on the token's own rank
    remote_copies: float  # k (1 - 1/W)
    remote_ranks: float  # distinct other ranks among the k experts' owners
    inter_node_copies: float  # k (1 - 1/nnodes)
    dispatch_row_fp8: int  # H + H/32
    dispatch_row_bf16: int  # 2 H
    combine_row_bf16: int  # 2 H
    sent_dispatch_row: int  # 2 H + 8: bf16 row, fp32 expert id and weight (ep_dispatch.py)
    sent_combine_row: int  # 4 H: the packed experts' fp32 output
    gather_row: int  # 2 H + 8 k: a row and its routing in the former all-gather

    @property
    def dispatch_fp8(self) -> float:
        return self.remote_copies * self.dispatch_row_fp8

    @property
    def dispatch_bf16(self) -> float:
        return self.remote_copies * self.dispatch_row_bf16

    @property
    def combine_bf16(self) -> float:
        return self.remote_copies * self.combine_row_bf16

    @property
    def inter_node_bytes(self) -> float:
        """FP8 dispatch plus bf16 combine of the copies that leave the node."""
        return self.inter_node_copies * (self.dispatch_row_fp8 + self.combine_row_bf16)

    @property
    def sent_bytes(self) -> float:
        """Dispatch plus combine as engine/model/ep_dispatch.py sends them."""
        return self.remote_copies * (self.sent_dispatch_row + self.sent_combine_row)

    @property
    def gather_bytes(self) -> float:
        """The former all-gather of the rows plus the fp32 all-reduce of all ranks' rows."""
        others = self.world - 1
        return others * self.gather_row + 2 * others * self.sent_combine_row

    @property
    def dispatch_fp8_per_rank(self) -> float:
        """Dispatch, one row per distinct remote rank."""
        return self.remote_ranks * self.dispatch_row_fp8

    @property
    def combine_bf16_per_rank(self) -> float:
        return self.remote_ranks * self.combine_row_bf16


def ep_traffic(
    hidden_size: int, n_experts: int, top_k: int, world: int, nnodes: int = 1
) -> EPTraffic:
    """The module docstring's formulas for ``world`` ranks over ``nnodes`` nodes."""
    if world < 1 or nnodes < 1 or world % nnodes:
        raise ValueError(f"{world} ranks do not split evenly over {nnodes} node(s)")
    if n_experts % world:
        raise ValueError(f"{n_experts} experts do not split evenly over {world} ranks")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top-k {top_k} outside 1..{n_experts}")
    if hidden_size % SCALE_BLOCK:
        raise ValueError(f"hidden size {hidden_size} is not a multiple of {SCALE_BLOCK}")
    per_rank = n_experts // world
    none_on_a_rank = comb(n_experts - per_rank, top_k) / comb(n_experts, top_k)
    return EPTraffic(
        world=world,
        nnodes=nnodes,
        experts_per_rank=per_rank,
        top_k=top_k,
        local_fraction=1 / world,
        remote_copies=top_k * (1 - 1 / world),
        remote_ranks=(world - 1) * (1 - none_on_a_rank),
        inter_node_copies=top_k * (1 - 1 / nnodes),
        dispatch_row_fp8=hidden_size + hidden_size // SCALE_BLOCK,
        dispatch_row_bf16=2 * hidden_size,
        combine_row_bf16=2 * hidden_size,
        sent_dispatch_row=2 * hidden_size + 8,
        sent_combine_row=4 * hidden_size,
        gather_row=2 * hidden_size + 8 * top_k,
    )


def ep_traffic_of(config: ModelConfig, world: int, nnodes: int = 1) -> EPTraffic:
    return ep_traffic(
        config.hidden_size, config.n_routed_experts, config.num_experts_per_tok, world, nnodes
    )


def format_ep_traffic(config: ModelConfig, rows: list[tuple[int, int]]) -> list[str]:
    """A table of ``ep_traffic_of`` for each (world, nnodes), per token per MoE layer."""
    layers = config.num_hidden_layers
    lines = [
        f"EP traffic per token per MoE layer (H={config.hidden_size}, top-"
        f"{config.num_experts_per_tok} of {config.n_routed_experts}; x{layers} layers per token)",
        f"  {'ranks':>5} {'nodes':>5} {'E/rank':>6} {'local':>6} {'remote':>7} "
        f"{'FP8 disp B':>11} {'bf16 disp B':>11} {'combine B':>10} {'ranks':>6} "
        f"{'FP8+comb/rank B':>15} {'off-node':>8} {'off-node B':>10} {'sent B':>8} "
        f"{'all-gather B':>12}",
    ]
    for world, nnodes in rows:
        t = ep_traffic_of(config, world, nnodes)
        lines.append(
            f"  {world:>5} {nnodes:>5} {t.experts_per_rank:>6g} {t.local_fraction:>6.3f} "
            f"{t.remote_copies:>7.3f} {t.dispatch_fp8:>11,.0f} {t.dispatch_bf16:>11,.0f} "
            f"{t.combine_bf16:>10,.0f} {t.remote_ranks:>6.3f} "
            f"{t.dispatch_fp8_per_rank + t.combine_bf16_per_rank:>15,.0f} "
            f"{t.inter_node_copies:>8.3f} {t.inter_node_bytes:>10,.0f} "
            f"{t.sent_bytes:>8,.0f} {t.gather_bytes:>12,.0f}"
        )
    return lines
