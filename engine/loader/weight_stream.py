"""Stream checkpoint tensors into a model's parameters, a slice at a time.

``load_checkpoint`` plans what to read (names, formats, shapes, checked from the
shard headers); this module does the reading. Host memory during a load stays near the
model's own bytes (when it is on the CPU) plus tens of MiB, whatever the
checkpoint's size:

* shards are memory-mapped by safetensors and read in file order; a mapping is
  closed (and so its resident file pages released) as soon as the shard's last
  tensor has been placed, or once ``REMAP_BYTES`` have been read through it
  (mid-tensor too: an Engram table is larger than the host's spare memory);
* each tensor is read in row slices of at most ``CHUNK_ELEMENTS`` logical
  elements, converted to fp32 (dequantised when quantised) and copied into the
  parameter on its device, so the fp32 temporaries of a conversion are a few
  MiB whatever the tensor's size (a whole Engram table in fp32 would be 4x its
  stored bytes, several times over while the scales are expanded).

A progress bar (tqdm, on stderr) counts the stored bytes read; one INFO line at
the end gives the bytes placed per device, the seconds and the GB/s.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

logger = logging.getLogger(__name__)

# Logical elements converted per slice: 2 MiB per fp32 temporary, of which a
# dequantisation holds about three at once.
CHUNK_ELEMENTS = 1 << 19

# Stored bytes read through one shard mapping before it is unmapped (see _OpenShards).
REMAP_BYTES = 32 << 20

# Stored tensor -> fp32 logical tensor, for a row slice of the weight and of its scale.
Convert = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, slots=True)
class TensorRead:
    """One parameter to fill from the checkpoint.

    ``scale``: the stored name of its E8M0 scales (None: stored plain).
    ``scale_rows``: logical rows one scale row covers (32 for FP8 blocks, else 1);
    a slice then starts on a multiple of it. ``nbytes``: stored bytes of the
    weight and its scale, from the headers (what the progress bar counts).
    ``row_offset``: the target is stored rows ``[row_offset, row_offset + rows)``
    (a tensor-parallel shard; a multiple of ``scale_rows``); None: all of them.
    """

    name: str
    target: torch.Tensor
    convert: Convert
    nbytes: int
    scale: str | None = None
    scale_rows: int = 1
    row_offset: int | None = None


@dataclass(slots=True)
class LoadStats:
    """What a streaming load read and placed."""

    bytes_read: int = 0  # stored bytes (weights and scales)
    seconds: float = 0.0
    shards: int = 0
    placed: Counter[str] = field(default_factory=Counter)  # device -> parameter bytes

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / self.seconds if self.seconds > 0 else 0.0

    def summary(self, label: str) -> str:
        devices = ", ".join(f"{d} {n / 1e9:.3f} GB" for d, n in sorted(self.placed.items()))
        return (
            f"loaded {label}: {self.bytes_read / 1e9:.3f} GB ({self.bytes_read} B) from "
            f"{self.shards} shard(s) in {self.seconds:.2f} s ({self.gb_per_s:.2f} GB/s); "
            f"placed {devices or 'nothing'}"
        )


def show_progress(progress: bool | None) -> bool:
    """``progress`` None: a bar only when stderr is a terminal (not in logs or pipes)."""
    if progress is not None:
        return progress
    return sys.stderr.isatty()


class _OpenShards:
    """safetensors handles, each opened on first use and closed after its last read.

    A mapping keeps every page read through it resident (and counted in RSS)
    until it is unmapped, so a handle is also closed, and reopened on its next
    use, once ``REMAP_BYTES`` have been read through it, within a tensor too:
    at most about that much of a shard stays mapped.
    """

    def __init__(self, remaining: Counter[Path]) -> None:
        self._remaining = remaining
        self._open: dict[Path, Any] = {}  # safetensors has no public type for its handle
        self._mapped: Counter[Path] = Counter()  # bytes read through the open handle
        self.files: set[Path] = set()
        self.opened = 0

    def handle(self, file: Path) -> Any:
        if file not in self._open:
            handle = safe_open(file, framework="pt", device="cpu")
            self._open[file] = handle.__enter__()
            self.files.add(file)
            self.opened += 1
        return self._open[file]

    def count(self, file: Path, nbytes: int) -> None:
        """``nbytes`` more read through ``file``'s mapping."""
        self._mapped[file] += nbytes

    def due(self, file: Path | None) -> bool:
        """``file``'s mapping holds ``REMAP_BYTES`` read pages or more: time to unmap it."""
        return file is not None and self._mapped[file] >= REMAP_BYTES

    def unmap_full(self) -> None:
        """Close the handles past ``REMAP_BYTES``. Slices taken from them pin their
        mapping: drop those first, take them again after."""
        for file in [f for f in self._open if self._mapped[f] >= REMAP_BYTES]:
            self._close(file)

    def done(self, file: Path) -> None:
        """One read of ``file`` finished; unmap it after its last."""
        self._remaining[file] -= 1
        if self._remaining[file] == 0 and file in self._open:
            self._close(file)

    def _close(self, file: Path) -> None:
        self._open.pop(file).__exit__(None, None, None)
        self._mapped[file] = 0

    def close(self) -> None:
        for file in list(self._open):
            self._close(file)


def _row_slices(rows: int, row_elements: int, scale_rows: int) -> list[tuple[int, int]]:
    """[r0, r1) row ranges of at most ``CHUNK_ELEMENTS`` (one aligned group at least)."""
    step = max(scale_rows, CHUNK_ELEMENTS // max(row_elements, 1) // scale_rows * scale_rows)
    return [(r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]


def _count(
    shards: _OpenShards,
    files: dict[str, Path],
    read: TensorRead,
    w: torch.Tensor,
    s: torch.Tensor | None,
) -> int:
    """Account one read of the weight (and scale) slices ``w``, ``s``; their bytes."""
    shards.count(files[read.name], w.nbytes)
    if s is None or read.scale is None:
        return w.nbytes
    shards.count(files[read.scale], s.nbytes)
    return w.nbytes + s.nbytes


def _fill(read: TensorRead, files: dict[str, Path], shards: _OpenShards) -> int:
    """Copy one tensor into its parameter, slice by slice; the stored bytes read."""
    target = read.target
    off = read.row_offset or 0
    if (target.dim() == 0 or target.numel() <= CHUNK_ELEMENTS) and read.row_offset is None:
        w = shards.handle(files[read.name]).get_tensor(read.name)
        s = shards.handle(files[read.scale]).get_tensor(read.scale) if read.scale else None
        target.copy_(read.convert(w, s))
        return _count(shards, files, read, w, s)

    def slices() -> tuple[Any, Any]:
        weight = shards.handle(files[read.name]).get_slice(read.name)
        scale = shards.handle(files[read.scale]).get_slice(read.scale) if read.scale else None
        return weight, scale

    weight, scale = slices()
    read_bytes = 0
    rows = target.shape[0]
    for r0, r1 in _row_slices(rows, math.prod(target.shape[1:]), read.scale_rows):
        w = weight[off + r0 : off + r1]
        s = None
        if scale is not None:
            s = scale[(off + r0) // read.scale_rows : math.ceil((off + r1) / read.scale_rows)]
        # fp32 on the CPU, rounded once into the parameter's dtype on its device.
        target[r0:r1].copy_(read.convert(w, s))
        read_bytes += _count(shards, files, read, w, s)
        del w, s
        if shards.due(files[read.name]) or shards.due(files.get(read.scale or "")):
            del weight, scale  # they pin the mappings
            shards.unmap_full()
            weight, scale = slices()
    return read_bytes


def stream_into(
    reads: Sequence[TensorRead],
    files: dict[str, Path],
    *,
    progress: bool | None = None,
    label: str = "checkpoint",
) -> LoadStats:
    """Fill every ``read.target`` from the shards in ``files`` (stored name -> file).

    Reads go shard by shard (in the order the shards are first named), so each
    shard is mapped once and released when done. ``progress``: show a tqdm bar
    on stderr (None: when stderr is a terminal).
    """
    first_seen = {file: i for i, file in enumerate(dict.fromkeys(files.values()))}
    ordered = sorted(reads, key=lambda r: first_seen[files[r.name]])
    remaining: Counter[Path] = Counter()
    for read in ordered:
        remaining[files[read.name]] += 1
        if read.scale:
            remaining[files[read.scale]] += 1
    total = sum(read.nbytes for read in ordered)
    stats = LoadStats()
    shards = _OpenShards(remaining)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        desc="loading weights",
        file=sys.stderr,
        disable=not show_progress(progress),
        mininterval=0.5,
        dynamic_ncols=True,
    )
    started = time.perf_counter()
    try:
        with torch.no_grad():
            for read in ordered:
                done = _fill(read, files, shards)
                shards.done(files[read.name])
                if read.scale:
                    shards.done(files[read.scale])
                shards.unmap_full()
                stats.bytes_read += done
                stats.placed[str(read.target.device)] += read.target.nbytes
                bar.update(done)
        if any(t.device.type == "cuda" for t in (r.target for r in ordered)):
            torch.cuda.synchronize()  # the last copies are placed, not only queued
    finally:
        shards.close()
        bar.close()
    stats.seconds = time.perf_counter() - started
    stats.shards = len(shards.files)
    if stats.bytes_read != total:
        # The headers promised other sizes than the slices returned: a planning bug.
        logger.warning("%s: read %d B, headers give %d B", label, stats.bytes_read, total)
    logger.info(stats.summary(label))
    return stats
