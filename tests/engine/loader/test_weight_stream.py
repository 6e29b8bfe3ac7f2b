"""Streaming load (engine/loader/weight_stream.py): slice by slice, one mapping at a time, a bar.

The checkpoint is the synthetic writer's (bench/load_bench.py) on a small
official-topology config: FP8 blocks, MXFP4 experts, FP8 Engram rows, BF16 and
FP32, several shards. The oracle reads each stored tensor whole with
safetensors and dequantises it in one call, the loader's path before streaming.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import engine.loader.weight_stream as weight_stream
from bench.load_bench import write_synthetic
from engine.loader.checkpoint import load_checkpoint
from engine.loader.files import INDEX_FILE
from engine.loader.formats import dequantize
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.weight_names import WEIGHTS
from engine.model.weights import scale_name

SHARD_BYTES = 3_000_000


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A small vocabulary keeps embed and head (BF16) from dominating the bytes.
    config = ModelConfig.tiny().replace(vocab_size=4096)
    return write_synthetic(tmp_path_factory.mktemp("synthetic"), config, SHARD_BYTES)


def _stored(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / INDEX_FILE).read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(path / file, framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return out


def _data_bytes(path: Path) -> int:
    """Bytes of tensor data in the shards: each file less its header."""
    total = 0
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as f:
            total += file.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
    return total


def test_streamed_slices_equal_whole_tensor_dequantisation(
    small_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Slices of 4096 elements (32-row groups for FP8 blocks, partial last slices)
    # and a remap every 64 KiB: every tensor larger than a slice is cut.
    monkeypatch.setattr(weight_stream, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(weight_stream, "REMAP_BYTES", 1 << 16)
    # Dequantised at load (packed experts: tests/engine/loader/test_checkpoint_experts.py).
    _, model = load_checkpoint(small_dir, dtype=torch.bfloat16, quantization="none")
    stored = _stored(small_dir)
    cut = 0
    for name, value in model.state_dict().items():
        if name not in stored:  # buffers (RoPE tables) are computed, not stored
            continue
        fmt = WEIGHTS.format_of(name)
        scale = stored.get(scale_name(name)) if fmt and fmt.quantised else None
        expected = dequantize(
            fmt if scale is not None else None, stored[name], scale, torch.float32
        )
        assert torch.equal(value, expected.to(value.dtype)), name
        cut += value.numel() > 4096
    assert cut > 20  # many tensors were streamed in several slices


@dataclass
class Mappings:
    """Every safetensors handle the loader opens: its file, the bytes read through it."""

    live: list[int] = field(default_factory=list)
    most_live: int = 0
    files: list[str] = field(default_factory=list)
    read: list[int] = field(default_factory=list)
    largest_read: int = 0  # one get_tensor or one slice

    def opener(self) -> type:
        record = self

        class Handle:
            def __init__(self, file: Path, **kwargs: object) -> None:
                self._inner = safe_open(file, **kwargs)
                self._id = len(record.files)
                record.files.append(str(file))
                record.read.append(0)

            def __enter__(self) -> Handle:
                record.live.append(self._id)
                record.most_live = max(record.most_live, len(record.live))
                self._inner.__enter__()
                return self

            def __exit__(self, *exc: object) -> None:
                record.live.remove(self._id)
                self._inner.__exit__(*exc)

            def get_tensor(self, name: str) -> torch.Tensor:
                out = self._inner.get_tensor(name)
                record.read[self._id] += out.nbytes
                record.largest_read = max(record.largest_read, out.nbytes)
                return out

            def get_slice(self, name: str) -> object:
                inner = self._inner.get_slice(name)

                class Slice:
                    def __getitem__(self, index: object) -> torch.Tensor:
                        out = inner[index]
                        record.read[handle_id] += out.nbytes
                        record.largest_read = max(record.largest_read, out.nbytes)
                        return out

                handle_id = self._id
                return Slice()

        return Handle


def test_one_shard_mapped_at_a_time_and_all_unmapped(
    small_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    maps = Mappings()
    monkeypatch.setattr(weight_stream, "safe_open", maps.opener())
    load_checkpoint(small_dir)
    shards = len(list(small_dir.glob("*.safetensors")))
    assert shards >= 3
    assert maps.live == [] and maps.most_live == 1
    # Shard by shard, each mapped once (no shard here reaches REMAP_BYTES), in order.
    assert maps.files == sorted(set(maps.files)) and len(maps.files) == shards
    assert sum(maps.read) == _data_bytes(small_dir)


def test_a_mapping_is_dropped_after_remap_bytes_even_inside_a_tensor(
    small_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weight_stream, "CHUNK_ELEMENTS", 4096)
    monkeypatch.setattr(weight_stream, "REMAP_BYTES", 1 << 17)
    maps = Mappings()
    monkeypatch.setattr(weight_stream, "safe_open", maps.opener())
    load_checkpoint(small_dir)
    assert maps.live == [] and maps.most_live == 1
    # A mapping is dropped once the read that crosses the limit is done; the
    # Engram table alone (FP8 rows, 4096-element slices) needs many mappings.
    assert maps.largest_read < 1 << 17
    assert max(maps.read) < (1 << 17) + maps.largest_read
    assert len(maps.files) > 3 * len(set(maps.files))
    assert sum(maps.read) == _data_bytes(small_dir)


def test_progress_bar_reaches_every_stored_byte(
    small_dir: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="engine.loader.weight_stream"):
        load_checkpoint(small_dir, progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert bar.startswith("loading weights: 100%"), bar
    total = _data_bytes(small_dir)
    (summary,) = [r.getMessage() for r in caplog.records if r.name == "engine.loader.weight_stream"]
    found = re.search(r"\((\d+) B\) from (\d+) shard\(s\) in [\d.]+ s \([\d.]+ GB/s\)", summary)
    assert found, summary
    assert int(found[1]) == total
    assert int(found[2]) == len(list(small_dir.glob("*.safetensors")))
    # Placed: every checkpoint tensor's byte in the model (parameters, the packed
    # experts' and packed linears' buffers), on the CPU.
    _, model = load_checkpoint(small_dir)
    resident = sum(t.nbytes for t in model.state_dict().values())
    assert f"placed cpu {resident / 1e9:.3f} GB" in summary


def test_no_bar_unless_stderr_is_a_terminal(
    small_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    load_checkpoint(small_dir)  # progress=None: pytest's stderr is not a terminal
    assert "loading weights" not in capsys.readouterr().err
    load_checkpoint(small_dir, progress=False)
    assert "loading weights" not in capsys.readouterr().err
