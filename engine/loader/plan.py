"""The load plan: which stored tensor goes into which parameter, and how.

Every name, dtype and shape is checked against the model from the shard headers
before any data is read (``plan_tensors``); each accepted tensor then becomes
one or two ``TensorRead`` s (``plan_reads``): dequantised in fp32 a row slice at
a time, copied byte for byte into a packed buffer (routed experts, FP8 linears),
cut to this rank's TP shard (engine/loader/tp_shards.py) or, for an Engram table
left in the checkpoint's files, mapped instead of read. ``stream_into``
(engine/loader/weight_stream.py) performs the reads.

Which tensor is stored how, what is skipped and what may be absent are the
model's name rules (``WeightRules``); the stacked packed modules and the mapped
tables are reached through its ``LoadHooks`` (both on its registry entry,
engine/model/registry.py), so nothing here names a model's tensors or classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.loader.files import Shards
from engine.loader.formats import (
    FLOAT_DTYPES,
    QUANT_BLOCK,
    CheckpointError,
    dequantize,
    stored_shapes,
)
from engine.loader.tp_shards import tp_packed_reads, tp_shard_read, tp_shard_targets
from engine.loader.weight_stream import TensorRead
from engine.model.parallel import Parallel
from engine.model.registry import ModelSpec, PackedSlice
from engine.model.weights import WeightFormat, WeightRules, scale_name

# The kind of a tensor a load leaves out on purpose (its notice), or None.
LeftOut = Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """A stored tensor the plan accepted for a model tensor of the same name."""

    name: str
    quantised: WeightFormat | None  # None: stored as a plain float tensor


def _check(name: str, found: tuple[int, ...], expected: tuple[int, ...], what: str) -> None:
    if found != expected:
        raise CheckpointError(name, f"has shape {list(found)}, expected {list(expected)} ({what})")


def _loadable(
    files: dict[str, Path], rules: WeightRules, also_skip: LeftOut | None, serves_vision: bool
) -> tuple[set[str], dict[str, int]]:
    """The stored names this load reads, and the count of each kind it skips."""
    skipped: dict[str, int] = {}
    loadable = set()
    for name in files:
        kind = rules.skipped(name, serves_vision) or (also_skip(name) if also_skip else None)
        if kind is None:
            loadable.add(name)
        else:
            skipped[kind] = skipped.get(kind, 0) + 1
    return loadable, skipped


def plan_tensors(
    targets: dict[str, torch.Tensor],
    files: dict[str, Path],
    shards: Shards,
    rules: WeightRules,
    also_skip: LeftOut | None = None,
) -> tuple[list[PlannedTensor], dict[str, int]]:
    """Validate names, dtypes and shapes from headers before any data is read.

    ``rules``: the model's storage formats, skipped kinds and optional tensors;
    ``also_skip``: the kind of a tensor this load leaves out on purpose, or None."""
    # A model with a vision tower has its tensors among the targets and reads them.
    serves_vision = any(rules.is_vision(n) for n in targets)
    loadable, skipped = _loadable(files, rules, also_skip, serves_vision)
    scales = {scale_name(n) for n in targets if (f := rules.format_of(n)) and f.quantised}
    unexpected = sorted(loadable - targets.keys() - scales)
    if unexpected:
        raise CheckpointError(
            unexpected[0],
            f"unexpected in the checkpoint, no such model tensor ({len(unexpected)} in all)",
        )
    missing = [name for name in targets if name not in loadable and not rules.optional(name)]
    if missing:
        raise CheckpointError(
            missing[0],
            f"missing from the checkpoint, expected shape {list(targets[missing[0]].shape)} "
            f"({len(missing)} missing in all)",
        )

    entries = []
    for name, target in targets.items():
        if name not in loadable:  # an optional tensor this export leaves out
            continue
        fmt = rules.format_of(name)
        shape = tuple(target.shape)
        dtype, found = shards.header(name)
        scale = scale_name(name)
        if dtype in FLOAT_DTYPES:
            # Plain storage is always accepted (e.g. a BF16 re-export of an FP8 weight).
            if scale in loadable:
                raise CheckpointError(scale, f"unexpected: `{name}` is stored as {dtype}")
            _check(name, found, shape, f"stored as {dtype}")
            entries.append(PlannedTensor(name, None))
            continue
        if fmt is None or not fmt.quantised:
            raise CheckpointError(name, f"stored as {dtype}, expected a float dtype")
        if scale not in loadable:
            raise CheckpointError(scale, f"missing: `{name}` is stored as {dtype}")
        want_weight, want_scale = stored_shapes(fmt, shape)
        _check(name, found, want_weight, f"{fmt.value} of logical shape {list(shape)}")
        _, scale_found = shards.header(scale)
        assert want_scale is not None
        _check(scale, scale_found, want_scale, f"E8M0 scales of {fmt.value}")
        entries.append(PlannedTensor(name, fmt))
    return entries, skipped


def tensor_read(entry: PlannedTensor, target: torch.Tensor, shards: Shards) -> TensorRead:
    """How ``stream_into`` fills ``target``: dequantised in fp32, one row slice at a time."""
    fmt = entry.quantised
    scale = scale_name(entry.name) if fmt else None
    nbytes = shards.nbytes(entry.name) + (shards.nbytes(scale) if scale else 0)

    def convert(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return dequantize(fmt, weight, scales, torch.float32)

    rows = QUANT_BLOCK if fmt is WeightFormat.FP8_BLOCK else 1
    return TensorRead(entry.name, target, convert, nbytes, scale, rows)


# ----------------------------------------------------------------- routed experts


def experts_stored_packed(files: dict[str, Path], shards: Shards, rules: WeightRules) -> bool:
    """True when the checkpoint has routed experts and stores every one as MXFP4 bytes."""
    names = [n for n in files if rules.format_of(n) is WeightFormat.MXFP4 and not rules.skipped(n)]
    return bool(names) and all(shards.header(n)[0] not in FLOAT_DTYPES for n in names)


def packed_expert_targets(
    model: nn.Module, targets: dict[str, torch.Tensor], spec: ModelSpec
) -> dict[str, PackedSlice]:
    """Take the packed stacked modules' entries (the routed experts, by the
    model's ``LoadHooks.packed_slices``) out of ``targets`` (state-dict views).

    Each weight is replaced by a ``meta`` placeholder of its logical shape, so
    ``plan_tensors`` checks the stored shapes exactly as for a dequantised load;
    its scale entry leaves ``targets`` (the plan expects it as the weight's sibling).
    """
    packed: dict[str, PackedSlice] = {}
    for key, piece in spec.loading.packed_slices(model).items():
        if key not in targets:  # a layer this load leaves out
            continue
        del targets[scale_name(key)]
        targets[key] = torch.empty(*piece.shape, device="meta")
        packed[key] = piece
    return packed


def _byte_copy(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return weight.view(torch.uint8)


def packed_expert_reads(
    entry: PlannedTensor, target: PackedSlice, shards: Shards
) -> list[TensorRead]:
    """Two byte-for-byte reads (the E2M1 pairs, the E8M0 scales): nothing dequantised."""
    if entry.quantised is not WeightFormat.MXFP4:
        raise CheckpointError(
            entry.name, "stored unquantised in a checkpoint loaded with packed experts"
        )
    reads = []
    for stored, dest in ((entry.name, target.weight), (scale_name(entry.name), target.scale)):
        reads.append(TensorRead(stored, dest.view(torch.uint8), _byte_copy, shards.nbytes(stored)))
    return reads


# ----------------------------------------------------------------- packed weights


def packable_weights(
    names: list[str], files: dict[str, Path], shards: Shards, rules: WeightRules
) -> list[str]:
    """The FP8_BLOCK weights among ``names`` that the checkpoint stores packed.

    Packed means ``F8_E4M3`` with an ``F8_E8M0`` (or ``U8``) ``.scale``; a BF16
    re-export of the same weight (or V3-style float scales) loads dequantised.
    Routed experts (MXFP4) and lookup tables (FP8_ROWS) are not FP8_BLOCK: never here.
    """
    packable = []
    for name in names:
        scale = scale_name(name)
        if rules.format_of(name) is not WeightFormat.FP8_BLOCK or name not in files:
            continue
        if scale not in files or shards.header(name)[0] != "F8_E4M3":
            continue
        if shards.header(scale)[0] in ("F8_E8M0", "U8"):
            packable.append(name)
    return packable


def _stored_bytes(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return weight  # packed: the stored bytes, as they are


def packed_reads(name: str, targets: dict[str, torch.Tensor], shards: Shards) -> list[TensorRead]:
    """A packed weight and its scale, each copied byte for byte into its buffer."""
    reads = []
    for stored in (name, scale_name(name)):
        dtype, _ = shards.header(stored)
        target = targets[stored]
        if dtype == "U8":  # raw E8M0 bytes: the buffer's byte view takes them
            target = target.view(torch.uint8)
        reads.append(TensorRead(stored, target, _stored_bytes, shards.nbytes(stored)))
    return reads


# ----------------------------------------------------------------- the whole plan


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """What a load keeps packed or mapped, and which share of the model it reads."""

    spec: ModelSpec  # the checkpoint's model: its name rules and load hooks
    dtype: torch.dtype  # of a mapped table's rows
    engram_mmap: bool
    packed_linears: frozenset[str]  # FP8-block weights kept as their stored bytes
    parallel: Parallel
    left_out: LeftOut  # decoder layers of an encoder-only load, other ranks' experts


@dataclass(slots=True)
class LoadPlan:
    reads: list[TensorRead] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)  # kind -> tensors not read
    absent: list[str] = field(default_factory=list)  # optional tensors, set to zeros


def plan_reads(
    model: nn.Module, files: dict[str, Path], shards: Shards, options: LoadOptions
) -> LoadPlan:
    """Every read that fills ``model`` from ``files``; optional tensors the export
    lacks are zeroed and mapped tables attached on the way (no data read)."""
    rules = options.spec.weights
    targets = model.state_dict(keep_vars=True)
    packed = packed_expert_targets(model, targets, options.spec)
    tp = tp_shard_targets(targets, options.parallel)
    # A packed weight's `.scale` is a buffer of the model now: the plan sees it as
    # the weight's sibling, as for a dequantised load.
    packed_scales = {scale_name(n) for n in options.packed_linears}
    planned = {n: t for n, t in targets.items() if n not in packed_scales}
    entries, skipped = plan_tensors(planned, files, shards, rules, options.left_out)
    plan = LoadPlan(skipped=skipped)
    plan.absent = [n for n in targets if rules.optional(n) and n not in files]
    for name in plan.absent:
        targets[name].zero_()
    for entry in entries:
        if options.engram_mmap and rules.format_of(entry.name) is WeightFormat.FP8_ROWS:
            quantised = entry.quantised is not None
            options.spec.loading.map_table(model, entry.name, files, quantised, options.dtype)
        elif entry.name in packed:
            plan.reads.extend(packed_expert_reads(entry, packed[entry.name], shards))
        elif entry.name in tp and entry.name in options.packed_linears:
            scale = targets[scale_name(entry.name)]
            shard = tp[entry.name]
            plan.reads.extend(tp_packed_reads(entry.name, entry.quantised, shard, scale, shards))
        elif entry.name in tp:
            plan.reads.append(tp_shard_read(entry.name, entry.quantised, tp[entry.name], shards))
        elif entry.name in options.packed_linears:
            plan.reads.extend(packed_reads(entry.name, targets, shards))
        else:
            plan.reads.append(tensor_read(entry, targets[entry.name], shards))
    return plan
