"""A checkpoint directory's safetensors files: which file holds each tensor, and
each tensor's header (dtype, shape), read without touching its data.

A directory holds ``config.json`` and either ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.loader.formats import stored_nbytes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """One tensor as the checkpoint stores it (header only, no data read)."""

    name: str
    dtype: str  # safetensors dtype string: BF16, F32, F8_E4M3, F8_E8M0, I8, ...
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        return stored_nbytes(self.dtype, self.shape)


def weight_map(path: str | Path) -> dict[str, Path]:
    """Tensor name -> file, from the shard index or the single file's header."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        with open(index, encoding="utf-8") as f:
            entries = json.load(f)["weight_map"]
        return {name: path / file for name, file in entries.items()}
    single = path / SINGLE_FILE
    if not single.exists():
        raise FileNotFoundError(f"{path} has neither {INDEX_FILE} nor {SINGLE_FILE}")
    with safe_open(single, framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), single)


def iter_checkpoint_tensors(path: str | Path) -> Iterator[StoredTensor]:
    """Every stored tensor (weights and scales) in file order, from headers only."""
    by_file: dict[Path, list[str]] = {}
    for name, file in weight_map(path).items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in names:
                header = f.get_slice(name)
                yield StoredTensor(name, header.get_dtype(), tuple(header.get_shape()), file)


class Shards:
    """Open shard handles, opened on first use and closed together."""

    def __init__(self, files: dict[str, Path]) -> None:
        self._files = files
        self._open: dict[Path, Any] = {}  # safetensors has no public type for its handle
        self._stack = ExitStack()

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _handle(self, name: str) -> Any:
        file = self._files[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(
                safe_open(file, framework="pt", device="cpu")
            )
        return self._open[file]

    def header(self, name: str) -> tuple[str, tuple[int, ...]]:
        header = self._handle(name).get_slice(name)
        return header.get_dtype(), tuple(header.get_shape())

    def nbytes(self, name: str, rows: int | None = None) -> int:
        """Stored bytes of ``name``, or of its first ``rows`` rows' worth."""
        dtype, shape = self.header(name)
        if rows is not None:
            shape = (rows, *shape[1:])
        return stored_nbytes(dtype, shape)

    def read(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)
