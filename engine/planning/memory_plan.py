"""Memory plan of a V4.1 config on N devices (``inspect --plan``, checked by ``serve``).

Per device: the weight bytes of every kind as the release stores them (packed:
FP8 E4M3 dense projections, MXFP4 routed experts, fp32 / bf16 small tensors,
bf16 embedding and head), the activation and scratch reserve, the SWA KV of
the running sequences, and what is left for the paged global-KV pool with its
capacity in tokens. The Engram tables are planned in host memory.

Parameter shapes come from ``engine.planning.accounting.param_shapes`` (the model
built on ``meta``) and each tensor's storage format from
the model's name rules (``ModelSpec.weights``, engine/model/registry.py); nothing
here re-derives a shape.

The topology (``Topology``, vLLM's flag names) says how the weights are
split over ``devices = T x D`` ranks, rank ``r = dp_rank * T + tp_rank`` (a TP
group is contiguous and stays within a node):

- tensor parallel ``T``: query heads (``attn.wq_b``, the sinks), the ``wo_a``
  groups, ``wo_b``'s input and the shared expert's intermediate are split T
  ways (``tp_shard_shape``); the 512-d latent KV projection, ``wq_a``, the
  indexer, the compressor, Engram's projections, router, norms, embedding and
  head are replicated, and so is the KV: every rank of a TP group holds every
  KV byte of the group's sequences;
- data parallel ``D``: each of the D groups serves its own sequences with its
  own KV pool, so the capacity is the sum of the groups' pools;
- expert parallel (``--enable-expert-parallel``): rank r holds the routed
  experts ``[r*E/W, (r+1)*E/W)`` of every layer (W = T x D, the first
  ``E mod W`` ranks one more); without it every rank holds all E (TP does not
  split routed experts), which for the official config fits no device.

Ranks that hold the same bytes form one "device kind". ``--devices N`` with no
topology given plans ``D = N`` with expert parallelism, the layout the plan
recommends (docs/deploy.md).

The reserve rule (``reserve_bytes``), documented in docs/design/memory-plan.md:
``RUNTIME_RESERVE_BYTES`` for the CUDA context, allocator slack and GEMM
workspaces, plus ``ACTIVATION_BUFFERS`` fp32 buffers of one step's rows at the
mHC width (``max_num_batched_tokens x hc_mult x hidden_size x 4 B``), plus fp32
logits of ``max_num_seqs`` rows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from engine.loader.formats import QUANT_BLOCK
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.parallel import tp_split_dim
from engine.model.registry import spec_of
from engine.model.weights import WeightFormat
from engine.planning.accounting import param_shapes, swa_kv_bytes_per_request
from kvstore.device.layout import kv_layout

GIB = 1 << 30
RUNTIME_RESERVE_BYTES = 2 * GIB
ACTIVATION_BUFFERS = 8  # residual streams, their mix, sublayer input/output, MoE in/out, slack


class WeightKind(StrEnum):
    """One line of the plan's weight table."""

    DENSE_FP8_TP = "dense_fp8_tp"  # query heads, wo_a/wo_b, shared expert: split by TP
    DENSE_FP8 = "dense_fp8"  # wq_a, latent wkv, indexer q, Engram wkv: replicated
    DENSE_FP8_SCALES = "dense_fp8_scales"  # E8M0, 1 B per 32x32 block
    EXPERTS_FP4 = "experts_fp4"  # routed experts: E2M1 pairs, 0.5 B/param
    EXPERTS_FP4_SCALES = "experts_fp4_scales"  # E8M0, 1 B per 32 along K
    BF16_PROJECTIONS = "bf16_projections"  # router, compressor, indexer keys, Engram gates
    NORMS_MHC_SINKS_BIASES = "norms_mhc_sinks_biases"  # fp32 (the checkpoint's format)
    EMBED_HEAD = "embed_head"  # bf16
    VISION = "vision"  # the vision tower, aligner and span vectors, as stored: replicated
    DSPARK = "dspark"  # the DSpark drafter (mtp.*), as stored: replicated


class HostKind(StrEnum):
    ENGRAM_FP8 = "engram_fp8"  # Engram table rows, E4M3, 1 B/param
    ENGRAM_SCALES = "engram_scales"  # E8M0, 1 B per 32 along each row


WEIGHT_KIND_LABELS: dict[str, str] = {
    WeightKind.DENSE_FP8_TP: "heads/wo/shared expert, FP8 (TP-split)",
    WeightKind.DENSE_FP8: "other dense projections, FP8 E4M3",
    WeightKind.DENSE_FP8_SCALES: "dense scales, E8M0 per 32x32",
    WeightKind.EXPERTS_FP4: "routed experts, MXFP4 E2M1",
    WeightKind.EXPERTS_FP4_SCALES: "expert scales, E8M0 per 32",
    WeightKind.BF16_PROJECTIONS: "router/compressor/indexer, bf16",
    WeightKind.NORMS_MHC_SINKS_BIASES: "norms, mHC, sinks, biases, fp32",
    WeightKind.EMBED_HEAD: "embedding and head, bf16",
    WeightKind.VISION: "vision tower and aligner, bf16/fp32",
    WeightKind.DSPARK: "DSpark drafter, as stored (replicated)",
    HostKind.ENGRAM_FP8: "Engram tables, FP8 E4M3 (host)",
    HostKind.ENGRAM_SCALES: "Engram scales, E8M0 per 32 (host)",
}

_FORMAT_BYTES = {WeightFormat.FP32: 4, WeightFormat.BF16: 2}


class PlanError(ValueError):
    """A plan that cannot be computed (bad device count or memory)."""


@dataclass(frozen=True, slots=True)
class Topology:
    """How ``world = T x D`` ranks share the model (vLLM's flag names)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    expert_parallel: bool = False
    nnodes: int = 1

    @property
    def world(self) -> int:
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def name(self) -> str:
        """``DP8 x EP8``, ``TP8 x EP8``, ``TP8 x DP2 x EP16``, ``DP8`` (no EP)."""
        parts = []
        if self.tensor_parallel_size > 1:
            parts.append(f"TP{self.tensor_parallel_size}")
        if self.data_parallel_size > 1 or self.tensor_parallel_size == 1:
            parts.append(f"DP{self.data_parallel_size}")
        if self.expert_parallel:
            parts.append(f"EP{self.world}")
        return " x ".join(parts)


def tp_shard_shape(
    name: str, shape: tuple[int, ...], tensor_parallel_size: int
) -> tuple[int, ...] | None:
    """One TP rank's shape of tensor ``name``, or None when TP replicates it."""
    dim = tp_split_dim(name)  # the rule the loader slices by
    if dim is None:
        return None
    out = list(shape)
    out[dim] //= tensor_parallel_size
    return tuple(out)


def check_topology(config: ModelConfig, devices: int, topology: Topology) -> None:
    """Raise ``PlanError`` naming what makes ``topology`` impossible for ``config``."""
    t, d, n = topology.tensor_parallel_size, topology.data_parallel_size, topology.nnodes
    if min(t, d, n) < 1:
        raise PlanError("--tensor-parallel-size, --data-parallel-size and --nnodes must be >= 1")
    if topology.world != devices:
        raise PlanError(
            f"--devices {devices} but --tensor-parallel-size {t} x --data-parallel-size {d} "
            f"= {topology.world}"
        )
    if devices % n:
        raise PlanError(f"{devices} devices do not split evenly over --nnodes {n}")
    for field_name, size in (
        ("num_attention_heads", config.num_attention_heads),
        ("o_groups", config.o_groups),
        ("moe_intermediate_size", config.moe_intermediate_size),
    ):
        if size % t:
            raise PlanError(f"--tensor-parallel-size {t} does not divide {field_name} ({size})")
    if (devices // n) % t:
        raise PlanError(
            f"--tensor-parallel-size {t} does not divide the {devices // n} devices of a node: "
            "a TP group must stay within one node"
        )
    if topology.expert_parallel and devices > config.n_routed_experts:
        raise PlanError(
            f"{devices} devices but only {config.n_routed_experts} routed experts to split"
        )


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """Packed bytes of a config's tensors, routed experts kept per expert."""

    replicated: dict[str, int]  # every device holds these
    per_expert: dict[str, int]  # one routed expert (of every layer), by kind
    n_experts: int
    host: dict[str, int]  # Engram tables


def weight_bytes(
    config: ModelConfig,
    shapes: dict[str, tuple[int, ...]] | None = None,
    tensor_parallel_size: int = 1,
) -> WeightBytes:
    """Bytes of one rank by kind, as the release stores each tensor (``ModelSpec.weights``).

    ``tensor_parallel_size`` T: the tensors TP splits (``tp_shard_shape``) count
    one T-th, their scales ``ceil`` of the shard's blocks.
    """
    shapes = param_shapes(config) if shapes is None else shapes
    spec = spec_of(config)
    embed_head = spec.params.embed_head
    replicated = dict.fromkeys(WeightKind, 0)
    experts = {WeightKind.EXPERTS_FP4: 0, WeightKind.EXPERTS_FP4_SCALES: 0}
    host = dict.fromkeys(HostKind, 0)
    for name, full in shapes.items():
        fmt = spec.weights.format_of(name)
        split = tp_shard_shape(name, full, tensor_parallel_size)
        shape = full if split is None else split
        numel = math.prod(shape)
        if spec.weights.is_drafter(name):
            # Its own expert count: one line of its stored bytes, whatever the format.
            replicated[WeightKind.DSPARK] += _stored_bytes(fmt, name, full)
            continue
        if fmt is WeightFormat.MXFP4:
            experts[WeightKind.EXPERTS_FP4] += numel // 2
            experts[WeightKind.EXPERTS_FP4_SCALES] += numel // QUANT_BLOCK
        elif fmt is WeightFormat.FP8_ROWS:
            host[HostKind.ENGRAM_FP8] += numel
            host[HostKind.ENGRAM_SCALES] += numel // QUANT_BLOCK
        elif fmt is WeightFormat.FP8_BLOCK:
            rows, cols = shape
            kind = WeightKind.DENSE_FP8 if split is None else WeightKind.DENSE_FP8_TP
            replicated[kind] += numel
            replicated[WeightKind.DENSE_FP8_SCALES] += math.ceil(rows / QUANT_BLOCK) * math.ceil(
                cols / QUANT_BLOCK
            )
        elif fmt is None:
            raise PlanError(f"tensor `{name}` has no storage format in engine/loader/formats.py")
        elif spec.weights.is_vision(name):
            replicated[WeightKind.VISION] += numel * _FORMAT_BYTES[fmt]
        elif name in embed_head:
            replicated[WeightKind.EMBED_HEAD] += numel * _FORMAT_BYTES[fmt]
        elif fmt is WeightFormat.BF16 and len(shape) == 2:
            replicated[WeightKind.BF16_PROJECTIONS] += numel * 2
        else:
            replicated[WeightKind.NORMS_MHC_SINKS_BIASES] += numel * _FORMAT_BYTES[fmt]
    replicated.pop(WeightKind.EXPERTS_FP4)
    replicated.pop(WeightKind.EXPERTS_FP4_SCALES)
    n = config.n_routed_experts
    per_expert = {}
    for kind, total in experts.items():
        per_expert[kind.value], rest = divmod(total, n)
        assert rest == 0, "routed experts differ in size"
    return WeightBytes(
        replicated={k.value: v for k, v in replicated.items()},
        per_expert=per_expert,
        n_experts=n,
        host={k.value: v for k, v in host.items()},
    )


def _stored_bytes(fmt: WeightFormat | None, name: str, shape: tuple[int, ...]) -> int:
    """Bytes of one tensor as the release stores it, its E8M0 scales included."""
    numel = math.prod(shape)
    if fmt is WeightFormat.MXFP4:
        return numel // 2 + numel // QUANT_BLOCK
    if fmt is WeightFormat.FP8_BLOCK:
        rows, cols = shape
        return numel + math.ceil(rows / QUANT_BLOCK) * math.ceil(cols / QUANT_BLOCK)
    if fmt is WeightFormat.FP8_ROWS:
        return numel + numel // QUANT_BLOCK
    if fmt is None:
        raise PlanError(f"tensor `{name}` has no storage format in engine/loader/formats.py")
    return numel * _FORMAT_BYTES[fmt]


def reserve_bytes(config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Activation and scratch reserve of one device (the rule in the module docstring)."""
    activations = (
        ACTIVATION_BUFFERS * max_num_batched_tokens * config.hc_mult * config.hidden_size * 4
    )
    logits = max_num_seqs * config.vocab_size * 4
    return RUNTIME_RESERVE_BYTES + activations + logits


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """One device kind: ``devices`` hold ``experts`` routed experts each and the same bytes."""

    devices: list[int]
    experts: int
    weights: dict[str, int]
    weights_bytes: int
    reserve_bytes: int
    swa_kv_bytes: int
    kv_pool_bytes: int  # what is left; 0 when nothing is
    kv_pool_pages: int
    kv_pool_tokens: int
    shortfall_bytes: int  # > 0: weights + reserve + SWA exceed the device


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    devices: int
    device_memory_bytes: int
    max_num_batched_tokens: int
    max_num_seqs: int
    page_tokens: int
    kv_bytes_per_token: float
    page_bytes: int
    host: dict[str, int]
    host_bytes: int  # per node: every node holds the Engram tables once
    topology: Topology = field(default_factory=Topology)
    n_routed_experts: int = 0
    device_kinds: list[DevicePlan] = field(default_factory=list)
    # Global-KV tokens each node can hold: the pools of its DP groups, one pool per TP
    # group (its ranks replicate the KV; the smallest rank's pool bounds the group).
    kv_tokens_per_node: list[int] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(d.shortfall_bytes == 0 for d in self.device_kinds)

    @property
    def kv_pool_tokens_total(self) -> int:
        """Global-KV tokens of the whole deployment (each sequence lives on one DP group)."""
        return sum(self.kv_tokens_per_node)

    @property
    def sharding(self) -> str:
        t = self.topology
        experts = (
            f"routed experts split over {t.world} ranks"
            if t.expert_parallel
            else "every rank holds all routed experts"
        )
        attention = (
            f"attention split {t.tensor_parallel_size} ways, KV replicated in each TP group"
            if t.tensor_parallel_size > 1
            else "attention replicated, each rank its own sequences and KV"
        )
        nodes = f"{t.nnodes} node" + ("s" if t.nnodes > 1 else "")
        return f"{t.name} on {nodes}: {experts}; {attention}"

    def refusal(self) -> str | None:
        """Why a server cannot start on these devices, naming the shortfall; None if it can."""
        worst = max(self.device_kinds, key=lambda d: d.weights_bytes)
        avail = self.device_memory_bytes
        if worst.weights_bytes > avail:
            message = (
                f"weights need {_gib(worst.weights_bytes)} GiB per device, {_gib(avail)} GiB "
                "available: "
            )
            if self.devices > 1 and not self.topology.expert_parallel:
                experts = sum(worst.weights[k] for k in _EXPERT_KINDS)
                return message + (
                    f"without --enable-expert-parallel every rank holds all "
                    f"{self.n_routed_experts} routed experts ({_gib(experts)} GiB); add "
                    f"--enable-expert-parallel to split them over the {self.devices} ranks"
                )
            return message + "use more devices"
        worst = max(self.device_kinds, key=lambda d: d.shortfall_bytes)
        if worst.shortfall_bytes > 0:
            need = worst.weights_bytes + worst.reserve_bytes + worst.swa_kv_bytes
            return (
                f"weights ({_gib(worst.weights_bytes)} GiB), activation reserve "
                f"({_gib(worst.reserve_bytes)} GiB) and SWA KV ({_gib(worst.swa_kv_bytes)} GiB) "
                f"need {_gib(need)} GiB per device, {_gib(avail)} GiB available: use more "
                "devices, or lower --max-num-batched-tokens / --max-num-seqs"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["topology"]["name"] = self.topology.name
        out["topology"]["world"] = self.topology.world
        out["sharding"] = self.sharding
        out["fits"] = self.fits
        out["kv_pool_tokens_total"] = self.kv_pool_tokens_total
        out["refusal"] = self.refusal()
        return out


_EXPERT_KINDS = (WeightKind.EXPERTS_FP4.value, WeightKind.EXPERTS_FP4_SCALES.value)


def memory_plan(
    config: ModelConfig,
    devices: int,
    device_memory_bytes: int,
    *,
    topology: Topology | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 64,
    page_tokens: int = 64,
    kv_dtype: str = "fp4",
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> MemoryPlan:
    """The plan of ``config`` on ``devices`` devices of ``device_memory_bytes`` each.

    ``topology`` None: ``D = devices``, expert-parallel when there is more than one.
    ``max_num_batched_tokens`` and ``max_num_seqs`` are per DP group (each runs
    its own steps), so the reserve and the SWA KV are the same on every rank.
    """
    if devices < 1:
        raise PlanError(f"--devices must be >= 1, got {devices}")
    if device_memory_bytes <= 0:
        raise PlanError("--device-memory-gib must be > 0")
    if topology is None:
        topology = Topology(data_parallel_size=devices, expert_parallel=devices > 1)
    check_topology(config, devices, topology)
    wb = weight_bytes(config, shapes, topology.tensor_parallel_size)
    layout = kv_layout(
        config.kv_source_layer_ids,
        config.compress_ratios,
        page_tokens,
        kv_dtype,  # type: ignore[arg-type]
    )
    reserve = reserve_bytes(config, max_num_batched_tokens, max_num_seqs)
    swa = max_num_seqs * swa_kv_bytes_per_request(config)
    # A single-process model only holds the DSpark drafter for now (TP and EP ranks
    # build none: engine/model/deepseek_v41/model.py); DP ranks are single processes.
    drafter_held = topology.tensor_parallel_size == 1 and not topology.expert_parallel
    groups: tuple[tuple[int, list[int]], ...]
    if topology.expert_parallel:
        base, extra = divmod(wb.n_experts, devices)
        groups = ((base + 1, list(range(extra))), (base, list(range(extra, devices))))
    else:
        groups = ((wb.n_experts, list(range(devices))),)
    kinds: list[DevicePlan] = []
    tokens_of_rank: dict[int, int] = {}
    for experts, ids in groups:
        if not ids:
            continue
        held = {**wb.replicated, **{k: per * experts for k, per in wb.per_expert.items()}}
        if not drafter_held:
            held[WeightKind.DSPARK.value] = 0
        weights = {k.value: held[k.value] for k in WeightKind}
        total = sum(weights.values())
        left = device_memory_bytes - total - reserve - swa
        pages = max(0, left) // layout.page_bytes
        kinds.append(
            DevicePlan(
                devices=ids,
                experts=experts,
                weights=weights,
                weights_bytes=total,
                reserve_bytes=reserve,
                swa_kv_bytes=swa,
                kv_pool_bytes=max(0, left),
                kv_pool_pages=pages,
                kv_pool_tokens=pages * layout.page_tokens,
                shortfall_bytes=max(0, -left),
            )
        )
        tokens_of_rank.update(dict.fromkeys(ids, pages * layout.page_tokens))
    t, per_node = topology.tensor_parallel_size, devices // topology.nnodes
    per_node_tokens = [0] * topology.nnodes
    for group in range(topology.data_parallel_size):
        ranks = range(group * t, (group + 1) * t)  # one TP group, within one node
        per_node_tokens[ranks[0] // per_node] += min(tokens_of_rank[r] for r in ranks)
    return MemoryPlan(
        devices=devices,
        device_memory_bytes=device_memory_bytes,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        page_tokens=page_tokens,
        kv_bytes_per_token=layout.bytes_per_token,
        page_bytes=layout.page_bytes,
        host=wb.host,
        host_bytes=sum(wb.host.values()),
        topology=topology,
        n_routed_experts=wb.n_experts,
        device_kinds=kinds,
        kv_tokens_per_node=per_node_tokens,
    )


def _gib(n: int | float) -> str:
    return f"{n / GIB:.1f}"


def format_plan(plan: MemoryPlan) -> list[str]:
    """The plan as lines: a table per device kind, one line per kind of bytes."""
    sharding = "every weight on it" if plan.devices == 1 else plan.sharding
    lines = [
        f"memory plan: {plan.devices} device(s) x {_gib(plan.device_memory_bytes)} GiB; {sharding}",
        f"  host (one copy per node): {_gib(plan.host_bytes)} GiB",
    ]
    for kind, n in plan.host.items():
        lines.append(f"    {WEIGHT_KIND_LABELS[kind]:<38}{n:>20,} B {_gib(n):>8} GiB")
    for d in plan.device_kinds:
        if len(d.devices) == 1:
            head = f"device {d.devices[0]} ({d.experts} routed experts per layer):"
        else:
            head = (
                f"devices {d.devices[0]}-{d.devices[-1]} (each: {d.experts} routed experts "
                "per layer):"
            )
        lines.append(f"  {head}")
        for kind, n in d.weights.items():
            lines.append(f"    {WEIGHT_KIND_LABELS[kind]:<38}{n:>20,} B {_gib(n):>8} GiB")
        rows = (
            ("weights, total", d.weights_bytes),
            (f"activation reserve ({plan.max_num_batched_tokens} rows)", d.reserve_bytes),
            (f"SWA KV ({plan.max_num_seqs} sequences)", d.swa_kv_bytes),
            ("global-KV pool (what is left)", d.kv_pool_bytes),
        )
        for label, n in rows:
            lines.append(f"    {label:<38}{n:>20,} B {_gib(n):>8} GiB")
        lines.append(
            f"    {'global-KV pool capacity':<38}{d.kv_pool_tokens:>20,} tokens "
            f"({plan.kv_bytes_per_token:g} B/token, {d.kv_pool_pages:,} pages of "
            f"{plan.page_tokens})"
        )
        if d.shortfall_bytes:
            lines.append(
                f"    {'SHORTFALL':<38}{d.shortfall_bytes:>20,} B {_gib(d.shortfall_bytes):>8} GiB"
            )
    if plan.topology.nnodes > 1:
        per_node = ", ".join(f"{n:,}" for n in plan.kv_tokens_per_node)
        lines.append(f"  global-KV tokens per node: {per_node}")
    lines.append(f"  global-KV tokens, all devices: {plan.kv_pool_tokens_total:,}")
    refusal = plan.refusal()
    if refusal:
        lines.append(f"  does not fit: {refusal}")
    return lines


def compared_topologies(devices: int, nnodes: int, config: ModelConfig) -> list[Topology]:
    """DP x EP and TP x EP for ``devices`` over ``nnodes``: the two layouts worth comparing.

    TP takes the largest size that divides a node's devices and the config's head,
    group and shared-expert sizes; the rest of the devices are DP groups.
    """
    per_node = devices // nnodes if nnodes >= 1 and devices % nnodes == 0 else devices
    sizes = (config.num_attention_heads, config.o_groups, config.moe_intermediate_size)
    tp = max(
        t for t in range(1, per_node + 1) if per_node % t == 0 and not any(s % t for s in sizes)
    )
    out = [Topology(1, devices, True, nnodes)]
    if tp > 1:
        out.append(Topology(tp, devices // tp, True, nnodes))
    return out


def format_comparison(plans: list[MemoryPlan]) -> list[str]:
    """Plans of one set of devices side by side: a column per topology, per-rank bytes."""
    first = plans[0]
    nodes = first.topology.nnodes
    lines = [
        f"topologies: {first.devices} x {_gib(first.device_memory_bytes)} GiB on {nodes} "
        f"node(s); per rank (the largest-expert rank), GiB unless stated; "
        f"{first.max_num_batched_tokens} rows, {first.max_num_seqs} sequences per DP group"
    ]
    width = 22
    label_w = 40

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"  {label:<{label_w}}" + "".join(f"{c:>{width}}" for c in cells))

    row("", [p.topology.name for p in plans])
    worst = [max(p.device_kinds, key=lambda d: d.weights_bytes) for p in plans]
    row("routed experts per layer per rank", [str(d.experts) for d in worst])
    for kind in WeightKind:
        row(WEIGHT_KIND_LABELS[kind], [_gib(d.weights[kind.value]) for d in worst])
    row("weights, total", [_gib(d.weights_bytes) for d in worst])
    row("activation reserve + SWA KV", [_gib(d.reserve_bytes + d.swa_kv_bytes) for d in worst])
    row(
        "global-KV pool per rank",
        [_gib(d.kv_pool_bytes) if d.kv_pool_bytes else "-" for d in worst],
    )
    row(
        f"pool per rank, tokens ({first.kv_bytes_per_token:g} B)",
        [f"{d.kv_pool_tokens:,}" for d in worst],
    )
    row("KV copies of a sequence", [str(p.topology.tensor_parallel_size) for p in plans])
    row("global-KV tokens per node", [f"{p.kv_tokens_per_node[0]:,}" for p in plans])
    if nodes > 1:
        row("global-KV tokens, all nodes", [f"{p.kv_pool_tokens_total:,}" for p in plans])
    row("host: Engram tables per node", [_gib(p.host_bytes) for p in plans])
    for p in plans:
        refusal = p.refusal()
        if refusal:
            lines.append(f"  {p.topology.name} does not fit: {refusal}")
    return lines


def detected_memory_bytes(device: str) -> int | None:
    """Total memory of ``device``: a CUDA device's, or the host's for ``cpu``; None if unknown.

    Total, not free: the plan describes the device, and another process's
    allocations would make it change from run to run.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(index).total_memory)
    if dev.type == "cpu":
        try:
            import os

            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None
