"""An Engram hash table kept in host memory as the checkpoint stores it.

The release's two tables hold 196.6B FP8 values (docs/design/checkpoints.md):
no device holds them, and reading them at start-up would cost minutes. A
``MappedEngramTable`` maps the table's bytes from its safetensors shard
(``mmap``, nothing read), and each step gathers only the rows its n-grams hash
to: unique ids, sorted so the page faults run forward through the file,
copied to the device as stored (FP8 bytes and E8M0 scales) and dequantised
there (E4M3 x 2^(scale - 127) per 32) into the model's dtype.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kernels.weight_formats import dequantize_fp8_rows

# safetensors dtype -> (bytes per element, torch dtype the raw bytes view as).
_STORED = {
    "F8_E4M3": (1, torch.uint8),
    "F8_E8M0": (1, torch.uint8),
    "BF16": (2, torch.bfloat16),
    "F16": (2, torch.float16),
    "F32": (4, torch.float32),
}


@dataclass(frozen=True, slots=True)
class TensorSpan:
    """Where one tensor's bytes lie in a safetensors file (from its header only)."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the first element
    nbytes: int


def tensor_span(file: str | Path, name: str) -> TensorSpan:
    """``name``'s span in ``file``: an 8-byte little-endian header length, the JSON
    header, then the data, each tensor's ``data_offsets`` counted from the data's start."""
    file = Path(file)
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    if name not in header:
        raise KeyError(f"{file}: no tensor {name!r}")
    entry = header[name]
    begin, end = entry["data_offsets"]
    return TensorSpan(
        file, entry["dtype"], tuple(entry["shape"]), 8 + header_len + begin, end - begin
    )


def _map_rows(span: TensorSpan) -> tuple[mmap.mmap, np.ndarray]:
    """The span as a read-only ``[rows, row_bytes]`` uint8 view of a file mapping."""
    if span.dtype not in _STORED:
        raise ValueError(f"{span.file}: Engram table stored as {span.dtype}, not a table dtype")
    rows = span.shape[0]
    row_bytes = math.prod(span.shape[1:]) * _STORED[span.dtype][0]
    if rows * row_bytes != span.nbytes:
        raise ValueError(f"{span.file}: {span.nbytes} bytes for shape {list(span.shape)}")
    with open(span.file, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    # Row ids are hashes: kernel read-ahead around each fault would read
    # neighbouring rows no step asked for.
    if hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)
    view = np.frombuffer(mapping, dtype=np.uint8, count=span.nbytes, offset=span.start)
    return mapping, view.reshape(rows, row_bytes)


@dataclass(eq=False)
class MappedEngramTable:
    """Rows of a memory-mapped table: FP8 E4M3 with its E8M0 ``.scale``, or a plain float.

    ``rows_read`` counts the rows gathered from the mapping (each unique id of a
    step once): the counting reader the tests check against the step's ids.
    ``prefetch``: before the gather, ask the kernel for every page the step needs
    (``MADV_WILLNEED``), so a table not in the page cache is read with many
    requests in flight instead of one fault at a time; it costs a system call per
    page when the pages are already resident (bench/engram_gather.py measures both).
    """

    weight: TensorSpan
    scale: TensorSpan | None
    dtype: torch.dtype = torch.float32
    prefetch: bool = False
    rows_read: int = 0
    gathers: int = 0
    _maps: list[mmap.mmap] = field(default_factory=list, repr=False)
    _weight_rows: np.ndarray | None = field(default=None, repr=False)
    _scale_rows: np.ndarray | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.weight.dtype == "F8_E4M3") != (self.scale is not None):
            raise ValueError(f"{self.weight.file}: an FP8 table needs its scale, a float one none")
        mapping, self._weight_rows = _map_rows(self.weight)
        self._maps.append(mapping)
        if self.scale is not None:
            if self.scale.shape != (self.weight.shape[0], self.weight.shape[1] // 32):
                raise ValueError(f"{self.scale.file}: scale shape {list(self.scale.shape)}")
            mapping, self._scale_rows = _map_rows(self.scale)
            self._maps.append(mapping)

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1]

    @property
    def host_bytes(self) -> int:
        """Bytes of the mapped table (weight and scale), none of them resident until read."""
        return self.weight.nbytes + (self.scale.nbytes if self.scale else 0)

    def mapped_address(self) -> int:
        """Start address of the weight's mapping (to find it in /proc/self/smaps)."""
        assert self._weight_rows is not None
        return int(self._weight_rows.__array_interface__["data"][0])

    def gather(self, ids: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """Dequantised rows ``[len(ids), dim]`` in ``self.dtype`` on ``device``; ``ids`` unique.

        Only the stored bytes cross to the device (264 B per FP8 row of 256, not
        512 in bf16); the dequantisation runs where the rows go.
        """
        assert self._weight_rows is not None
        index = ids.numpy()
        self.rows_read += len(index)
        self.gathers += 1
        if self.prefetch:
            self._will_need(index)
        raw = torch.from_numpy(self._weight_rows[index]).to(device)  # copies just these rows
        if self._scale_rows is None:
            values = raw.view(_STORED[self.weight.dtype][1]).to(torch.float32)
        else:
            scale = torch.from_numpy(self._scale_rows[index]).to(device)
            values = dequantize_fp8_rows(raw, scale, torch.float32)
        # fp32 first, one rounding into the model's dtype: the in-memory load's arithmetic.
        return values.to(self.dtype)

    def rows(self, row_ids: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows ``[*row_ids.shape, dim]`` for ``row_ids`` (any device), on ``device``."""
        flat = row_ids.reshape(-1).to("cpu", torch.long)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise IndexError(f"Engram row id out of range [0, {self.shape[0]})")
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        rows = self.gather(unique, device)
        return rows[inverse.to(device)].reshape(*row_ids.shape, self.shape[1])

    def _will_need(self, index: np.ndarray) -> None:
        spans = [self.weight, *([self.scale] if self.scale else [])]
        for mapping, span in zip(self._maps, spans, strict=True):
            row_bytes = span.nbytes // span.shape[0]
            pages = np.unique((span.start + index * row_bytes) // mmap.PAGESIZE)
            for page in pages.tolist():
                mapping.madvise(mmap.MADV_WILLNEED, page * mmap.PAGESIZE, mmap.PAGESIZE)

    def evict(self) -> None:
        """Unmap the resident pages and drop them from the page cache (cold-read benchmarks)."""
        for mapping in self._maps:
            mapping.madvise(mmap.MADV_DONTNEED)
        for span in {self.weight.file, *([self.scale.file] if self.scale else [])}:
            fd = os.open(span, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def __deepcopy__(self, memo: dict) -> MappedEngramTable:
        # Read-only bytes of a file: copies of a model share one mapping.
        return self
