"""A MoE layer's routed experts, stored stacked, run grouped by expert.

See docs/design/architecture.md §1.8 and docs/design/kernels.md ("Fused MoE").

Storage, per projection ``w1`` (gate) / ``w3`` (up) ``[E, I, D]`` and ``w2``
(down) ``[E, D, I]``:

* unpacked (training, float64 tests, ``quantization="none"`` loads):
  parameters in the model dtype;
* packed (the served release, built inside ``packed_experts()``): the
  checkpoint's MXFP4 bytes as buffers, E2M1 pairs ``int8 [E, I, D/2]`` /
  ``[E, D, I/2]`` and UE8M0 scale bytes ``uint8 [E, I, D/32]`` / ``[E, D, I/32]``,
  never dequantised whole.

``state_dict`` / ``load_state_dict`` keep the checkpoint's per-expert names
(``E.w1.weight``, plus ``E.w1.scale`` when packed; the scale as
``float8_e8m0fnu`` like the checkpoint): each entry is a view of expert E's
slice of the stacked tensor, so the loader, the writer, the accounting and the
memory plan see the same tensors as before the experts were stacked.

The forward sorts the step's (token, slot) pairs by expert (stable, so each
expert's rows stay in token order), runs only the experts that received rows
and adds their outputs back per token with one ``index_add_`` in fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.precision import compute_dtype, upcast
from kernels.act_memo import quantize_act_shared
from kernels.act_quant import dequantize_act_fp8, quantize_act_e4m3, quantize_act_fp8
from kernels.dispatch import use_triton
from kernels.moe_ops import expert_chunks, grouped_mxfp4_matmul, grouped_mxfp4_matmul_cpu
from kernels.weight_formats import BLOCK, quantize_mxfp4_weight

PROJECTIONS = ("w1", "w2", "w3")
SCALE = "_scale"  # buffer suffix of a packed projection's scale bytes

_PACKED: ContextVar[bool] = ContextVar("packed_experts", default=False)
_STATIC: ContextVar[bool] = ContextVar("static_expert_shapes", default=False)


@contextmanager
def packed_experts() -> Iterator[None]:
    """Build ``RoutedExperts`` that hold the checkpoint's MXFP4 bytes (see the module doc)."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


@contextmanager
def static_expert_shapes() -> Iterator[None]:
    """Unpacked experts run every local expert over every row, kept where routed.

    No shape then depends on the routing, so the forward holds no host sync and
    can be captured in a CUDA graph (docs/design/cuda-graphs.md). It costs
    ``n_experts / top_k`` times the routed FLOPs: for small (test, tiny) models
    only; packed experts never need it (their grouped GEMM takes device offsets).
    """
    token = _STATIC.set(True)
    try:
        yield
    finally:
        _STATIC.reset(token)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``; ``limit <= 0`` disables both."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@dataclass(frozen=True, slots=True)
class Routing:
    """A step's (token, slot) pairs sorted by expert: sorted row r is ``token[r]``'s pair."""

    token: torch.Tensor  # Long[R]
    weight: torch.Tensor  # [R, 1], the router's weight of that pair
    offsets: torch.Tensor  # Long[E + 1]: expert e owns sorted rows offsets[e]:offsets[e + 1]

    def counts(self) -> list[int]:
        """Rows per expert on the host (one device sync)."""
        return (self.offsets[1:] - self.offsets[:-1]).tolist()


def group_by_expert(
    weights: torch.Tensor, idx: torch.Tensor, n_experts: int, first: int = 0, shard: bool = False
) -> Routing:
    """Sort the router's choices ``idx [T, k]`` (weights ``[T, k]``) by expert.

    ``shard``: this rank holds only experts ``[first, first + n_experts)`` (expert
    parallelism); the pairs of other experts are dropped (one host sync for their count).
    """
    flat = idx.flatten()
    if shard:
        local = flat - first
        flat = torch.where((local >= 0) & (local < n_experts), local, n_experts)
    order = torch.argsort(flat, stable=True)
    # Expert e's rows start at the number of pairs below e: a search of the sorted ids,
    # with no host sync (bincount reads the ids' max on the host on CUDA; a decode
    # step captured as a CUDA graph cannot, docs/design/cuda-graphs.md).
    experts = torch.arange(n_experts + 1, dtype=flat.dtype, device=idx.device)
    offsets = torch.searchsorted(flat[order], experts)
    if shard:  # the other experts' pairs sort last, under the sentinel id n_experts
        order = order[: int(offsets[-1])]
    k = idx.shape[-1]
    return Routing(order // k, weights.flatten()[order].unsqueeze(-1), offsets)


class RoutedExperts(nn.Module):
    """The ``n_experts`` routed experts of one MoE layer (``layers.L.ffn.experts``).

    Under expert parallelism a rank holds experts ``[first, first + n_experts)`` of
    the layer's ``total`` (default: all of them); local index e is checkpoint expert
    ``first + e``, and the forward computes only the (token, slot) pairs routed to them.
    """

    # Registered in __init__ as parameters (unpacked) or buffers (packed).
    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor
    w1_scale: torch.Tensor
    w2_scale: torch.Tensor
    w3_scale: torch.Tensor

    def __init__(
        self,
        n_experts: int,
        dim: int,
        inter_dim: int,
        swiglu_limit: float,
        first: int = 0,
        total: int | None = None,
    ) -> None:
        super().__init__()
        self.n_experts, self.dim, self.inter_dim = n_experts, dim, inter_dim
        self.first = first
        self.total = n_experts if total is None else total
        if not (first >= 0 and first + n_experts <= self.total):
            raise ValueError(f"experts [{first}, {first + n_experts}) of {self.total}")
        self.swiglu_limit = swiglu_limit
        self.packed = _PACKED.get()
        shapes = self.shapes()
        if self.packed:
            if dim % BLOCK or inter_dim % BLOCK:
                raise ValueError(
                    f"packed experts need dims divisible by {BLOCK}: {dim}, {inter_dim}"
                )
            for name, (e, rows, cols) in shapes.items():
                self.register_buffer(name, torch.empty(e, rows, cols // 2, dtype=torch.int8))
                self.register_buffer(
                    name + SCALE, torch.empty(e, rows, cols // BLOCK, dtype=torch.uint8)
                )
        else:
            for name, shape in shapes.items():
                self.register_parameter(name, nn.Parameter(torch.empty(shape)))
            # nn.Linear's default init per expert slice, in the order of the
            # former per-expert modules (a seeded model keeps its values).
            with torch.no_grad():
                for e in range(n_experts):
                    for name in PROJECTIONS:
                        nn.init.kaiming_uniform_(getattr(self, name)[e], a=5**0.5)
        self.register_state_dict_post_hook(_per_expert_state_dict)
        self.register_load_state_dict_pre_hook(_stack_loaded_experts)

    def shapes(self) -> dict[str, tuple[int, int, int]]:
        """Logical ``[E, out, in]`` of each projection."""
        e, d, i = self.n_experts, self.dim, self.inter_dim
        return {"w1": (e, i, d), "w2": (e, d, i), "w3": (e, i, d)}

    def extra_repr(self) -> str:
        mode = "packed MXFP4" if self.packed else "unpacked"
        if self.n_experts != self.total:
            mode += f", experts {self.first}..{self.first + self.n_experts - 1} of {self.total}"
        return f"{self.n_experts} x ({self.dim} -> {self.inter_dim} -> {self.dim}), {mode}"

    def packed_copy(self) -> RoutedExperts:
        """The same experts through the checkpoint's MXFP4 encoder, as a packed module."""
        if self.packed:
            raise ValueError("already packed")
        with packed_experts(), torch.device(self.w1.device):
            out = RoutedExperts(
                self.n_experts, self.dim, self.inter_dim, self.swiglu_limit, self.first, self.total
            )
        with torch.no_grad():
            for name in PROJECTIONS:
                q, s = quantize_mxfp4_weight(getattr(self, name).detach())
                getattr(out, name).copy_(q)
                getattr(out, name + SCALE).copy_(s.view(torch.uint8))
        return out

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``sum_k weights[t, k] * E_{idx[t, k]}(x[t])`` for ``x [T, D]``, in the compute dtype.

        The routing weight scales the SwiGLU output before ``w2`` (as the release does).
        """
        if _STATIC.get() and not self.packed:
            return self._every_expert(x, weights, idx)
        shard = self.n_experts != self.total
        routing = group_by_expert(weights, idx, self.n_experts, self.first, shard)
        out = self._packed(x, routing) if self.packed else self._unpacked(x[routing.token], routing)
        y = torch.zeros(x.shape, dtype=compute_dtype(x), device=x.device)
        return y.index_add_(0, routing.token, upcast(out, y))

    def per_pair(
        self, rows: torch.Tensor, weight: torch.Tensor, local: torch.Tensor
    ) -> torch.Tensor:
        """The outputs of pairs, unsummed: row i of ``rows [P, D]`` through local expert
        ``local[i]`` with routing weight ``weight[i]`` (``[P, 1]``), in the input order.

        The expert-parallel owner's side of a dispatch (engine/model/ep_dispatch.py):
        each row is computed as ``forward`` computes it; fp32 when packed, else the
        rows' dtype, also for ``P = 0`` (the source sizes its receive buffer alike).
        """
        dtype = torch.float32 if self.packed else rows.dtype
        if rows.shape[0] == 0:
            return rows.new_zeros(0, self.dim, dtype=dtype)
        routing = group_by_expert(weight, local.unsqueeze(-1), self.n_experts)
        out = (
            self._packed(rows, routing)
            if self.packed
            else self._unpacked(rows[routing.token], routing)
        )
        return torch.empty_like(out, dtype=dtype).index_copy_(0, routing.token, out.to(dtype))

    def _unpacked(self, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
        """A loop over the active experts in the model dtype (the old per-expert arithmetic)."""
        pieces = []
        start = 0
        for e, count in enumerate(routing.counts()):
            if count == 0:
                continue
            xe = rows[start : start + count]
            gate = upcast(F.linear(xe, self.w1[e]))
            up = upcast(F.linear(xe, self.w3[e]))
            h = upcast(routing.weight[start : start + count]) * clamped_swiglu(
                gate, up, self.swiglu_limit
            )
            pieces.append(F.linear(h.to(rows.dtype), self.w2[e]))
            start += count
        if not pieces:
            return rows.new_zeros(0, self.dim)
        return torch.cat(pieces)

    def _every_expert(
        self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        """``forward`` under ``static_expert_shapes``: the same per-row formula and the same
        order of the per-token sum (experts ascending, from zero), with static shapes (a
        GEMM over every row may round a row differently from one over the expert's rows).
        A token picks an expert at most once, so its weight is the one slot's, or zero."""
        y = torch.zeros(x.shape, dtype=compute_dtype(x), device=x.device)
        local = idx - self.first
        for e in range(self.n_experts):
            hit = local == e  # [T, k]
            routed = hit.any(dim=-1, keepdim=True)
            w = torch.where(hit, weights, torch.zeros_like(weights)).sum(dim=-1, keepdim=True)
            gate = upcast(F.linear(x, self.w1[e]))
            up = upcast(F.linear(x, self.w3[e]))
            h = upcast(w) * clamped_swiglu(gate, up, self.swiglu_limit)
            out = F.linear(h.to(x.dtype), self.w2[e])
            y = torch.where(routed, y + upcast(out, y), y)
        return y

    def _packed(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Three grouped FP4 GEMMs over the active experts, activations quantised before each.

        On the CPU path ``x`` is quantised once per token, before its rows are
        gathered (the rule is per row, so a gathered row quantises alike), and
        through ``kernels.act_memo``, so the shared expert's ``w1`` and ``w3``
        reuse it.
        """
        offsets = routing.offsets
        if use_triton(x, self.w1, op="moe_gemm"):
            rows = x[routing.token]
            a = quantize_act_fp8(rows)
            gate = grouped_mxfp4_matmul(*a, offsets, self.w1, self.w1_scale)
            up = grouped_mxfp4_matmul(*a, offsets, self.w3, self.w3_scale)
            h = routing.weight.float() * clamped_swiglu(gate, up, self.swiglu_limit)
            return grouped_mxfp4_matmul(*quantize_act_fp8(h), offsets, self.w2, self.w2_scale)
        chunks = expert_chunks(offsets, routing.counts(), self.dim * self.inter_dim, x.device)
        xa = dequantize_act_fp8(*quantize_act_shared(x))[routing.token]
        gate = grouped_mxfp4_matmul_cpu(xa, offsets, self.w1, self.w1_scale, chunks=chunks)
        up = grouped_mxfp4_matmul_cpu(xa, offsets, self.w3, self.w3_scale, chunks=chunks)
        h = routing.weight.float() * clamped_swiglu(gate, up, self.swiglu_limit)
        ha = dequantize_act_fp8(*quantize_act_e4m3(h))
        return grouped_mxfp4_matmul_cpu(ha, offsets, self.w2, self.w2_scale, chunks=chunks)


def expert_key(prefix: str, expert: int, projection: str, scale: bool = False) -> str:
    """The checkpoint name of one expert's projection (``.weight``) or its ``.scale``."""
    return f"{prefix}{expert}.{projection}.{'scale' if scale else 'weight'}"


def _per_expert_state_dict(
    module: RoutedExperts, state: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """Replace the stacked entries by per-expert views, expert-major (the old order)."""
    stacked = {name: state.pop(prefix + name) for name in PROJECTIONS}
    scales = {}
    if module.packed:
        scales = {name: state.pop(prefix + name + SCALE) for name in PROJECTIONS}
    for e in range(module.n_experts):
        for name in PROJECTIONS:
            state[expert_key(prefix, module.first + e, name)] = stacked[name][e]
            if module.packed:
                state[expert_key(prefix, module.first + e, name, True)] = scales[name][e].view(
                    torch.float8_e8m0fnu
                )


def _stack_loaded_experts(
    module: RoutedExperts, state: dict[str, Any], prefix: str, *args: Any
) -> None:
    """The inverse: per-expert entries stacked under the module's own names.

    Entries are stacked only when every expert of a projection is present;
    otherwise ``load_state_dict`` reports the missing and unexpected keys.
    """
    kinds = [(False, "")] + ([(True, SCALE)] if module.packed else [])
    for name in PROJECTIONS:
        for is_scale, suffix in kinds:
            keys = [
                expert_key(prefix, module.first + e, name, is_scale)
                for e in range(module.n_experts)
            ]
            if all(k in state for k in keys):
                tensors = [state.pop(k) for k in keys]
                if is_scale:
                    tensors = [t.view(torch.uint8) for t in tensors]
                state[prefix + name + suffix] = torch.stack(tensors)
