"""Tensor-parallel shards: this rank's slice of every TP-split tensor, read from
the whole tensor the checkpoint stores (docs/design/parallelism.md).

The split rule is ``engine.model.parallel.TP_SPLIT``. Rows are read as a slice;
a column split reads whole rows, then keeps its columns. A packed FP8 weight's
shard keeps its stored bytes and the matching 32 x 32 blocks of its scale grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.loader.files import Shards
from engine.loader.formats import QUANT_BLOCK, CheckpointError, dequantize
from engine.loader.weight_stream import Convert, TensorRead
from engine.model.parallel import Parallel, tp_split_dim
from engine.model.weights import WeightFormat, scale_name


@dataclass(frozen=True, slots=True)
class TPShard:
    """Where one TP-split tensor's slice goes: stored ``[start, stop)`` along ``dim``."""

    target: torch.Tensor  # this rank's parameter
    dim: int
    start: int
    stop: int


def tp_shard_targets(targets: dict[str, torch.Tensor], parallel: Parallel) -> dict[str, TPShard]:
    """Take the TP-split entries (``engine.model.parallel.TP_SPLIT``) out of ``targets``.

    Each is replaced by a ``meta`` placeholder of the stored (whole) shape, so
    the plan checks the checkpoint exactly as for one process.
    """
    out: dict[str, TPShard] = {}
    if parallel.tp_size == 1:
        return out
    for name, target in list(targets.items()):
        dim = tp_split_dim(name)
        if dim is None:
            continue
        part = target.shape[dim]
        whole = list(target.shape)
        whole[dim] = part * parallel.tp_size
        start = parallel.tp_rank * part
        out[name] = TPShard(target, dim, start, start + part)
        targets[name] = torch.empty(whole, dtype=target.dtype, device="meta")
    return out


def check_tp_packed(model: nn.Module, packed: list[str], parallel: Parallel) -> None:
    """Refuse a packed TP-split weight whose shard is not whole 32 x 32 blocks.

    A shard keeps the stored bytes and its blocks' scales, so this rank's part
    along the split dimension (the module as built for this rank) must be a
    multiple of the block; with the official config and T <= 8 every part is.
    """
    if parallel.tp_size == 1:
        return
    for name in packed:
        dim = tp_split_dim(name)
        if dim is None:
            continue
        weight = model.get_submodule(name.removesuffix(".weight")).weight
        assert isinstance(weight, torch.Tensor), name
        part = weight.shape[dim]
        if part % QUANT_BLOCK:
            what = "rows" if dim == 0 else "columns"
            raise ValueError(
                f"{name}: TP rank's part is {part} {what}, not a multiple of the "
                f"{QUANT_BLOCK}-wide FP8 block, so its packed shard cannot keep the stored "
                f"bytes and scales (TP size {parallel.tp_size}); load with "
                f'quantization="none" or another TP size'
            )


def _stored_bytes(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return weight  # packed: the stored bytes, as they are


def tp_packed_reads(
    name: str, fmt: WeightFormat | None, shard: TPShard, scale: torch.Tensor, shards: Shards
) -> list[TensorRead]:
    """A packed shard, byte for byte: the E4M3 weight's ``[start, stop)`` along
    ``dim`` and the same block range ``[start / 32, stop / 32)`` of its E8M0 grid.

    Rows are read as slices; a column split reads whole rows and keeps its
    columns (as the dequantised path does). ``check_tp_packed`` made both ends
    block boundaries, so the blocks a shard holds are exactly its own.
    """
    if fmt is not WeightFormat.FP8_BLOCK:
        raise CheckpointError(name, "packed TP shard of a weight not stored as FP8 blocks")
    reads = []
    for stored, target, block in (
        (name, shard.target, 1),
        (scale_name(name), scale, QUANT_BLOCK),
    ):
        dtype, _ = shards.header(stored)
        if dtype == "U8":  # raw E8M0 bytes: the buffer's byte view takes them
            target = target.view(torch.uint8)
        start, stop = shard.start // block, shard.stop // block
        if shard.dim == 0:
            nbytes = shards.nbytes(stored, stop - start)
            reads.append(TensorRead(stored, target, _stored_bytes, nbytes, row_offset=start))
            continue
        nbytes = shards.nbytes(stored)
        reads.append(TensorRead(stored, target, _stored_columns(start, stop), nbytes))
    return reads


def _stored_columns(start: int, stop: int) -> Convert:
    def columns(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return weight[:, start:stop]

    return columns


def tp_shard_read(
    name: str, fmt: WeightFormat | None, shard: TPShard, shards: Shards
) -> TensorRead:
    """Rows ``[start, stop)`` read as a slice (on FP8 block boundaries, with their
    scales), or whole rows dequantised and cut to columns ``[start, stop)``."""
    scale = scale_name(name) if fmt else None
    block = QUANT_BLOCK if fmt is WeightFormat.FP8_BLOCK else 1
    start, stop = shard.start, shard.stop

    if shard.dim == 0:
        if start % block:
            raise CheckpointError(
                name, f"TP shard starts at row {start}, not on a {block}-row FP8 block"
            )
        nbytes = shards.nbytes(name, stop - start)
        if scale is not None:
            nbytes += shards.nbytes(scale, math.ceil(stop / block) - start // block)

        def convert(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
            return dequantize(fmt, weight, scales, torch.float32)

        return TensorRead(name, shard.target, convert, nbytes, scale, block, row_offset=start)

    nbytes = shards.nbytes(name) + (shards.nbytes(scale) if scale else 0)

    def columns(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        return dequantize(fmt, weight, scales, torch.float32)[:, start:stop]

    return TensorRead(name, shard.target, columns, nbytes, scale, block)
