"""Engram tables memory-mapped from the checkpoint (``MappedEngramTable``).

Oracles: the in-memory load of the same checkpoint (the dequantise-at-load
path), ``safetensors`` reading the stored tensors whole plus the kernels'
``dequantize_fp8_rows``, the model's own hash rows for the count of rows a
forward must read, and ``/proc/self/smaps`` for the pages the process mapped.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.loader import checkpoint
from engine.loader.checkpoint import load_checkpoint
from engine.loader.checkpoint_writer import make_tiny, save_checkpoint
from engine.loader.files import SINGLE_FILE
from engine.model.deepseek_v41.engram_table import MappedEngramTable, tensor_span
from engine.model.deepseek_v41.model import DeepseekV41
from kernels.weight_formats import dequantize_fp8_rows

IDS = torch.tensor([0, 5, 17, 99, 1234, 2, 64000, 7, 7, 128803, 31, 8, 5, 17, 99])
TABLE = "layers.1.engram.embed.weight"
SCALE = "layers.1.engram.embed.scale"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture(scope="module")
def in_memory(tiny_dir: Path) -> DeepseekV41:
    return load_checkpoint(tiny_dir, engram_mmap=False)[1].eval()


def _tables(model: DeepseekV41) -> list[MappedEngramTable]:
    return [b.engram.table for b in model.blocks if b.engram is not None]


def _smaps_rss_kib(address: int) -> int:
    """Resident KiB of this process's mapping that contains ``address``."""
    with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
        lines = f.read().splitlines()
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_span_is_the_tensors_bytes(tiny_dir: Path) -> None:
    file = tiny_dir / SINGLE_FILE
    span = tensor_span(file, TABLE)
    with safe_open(file, framework="pt") as f:
        stored = f.get_tensor(TABLE)
    assert span.dtype == "F8_E4M3" and span.shape == tuple(stored.shape)
    raw = file.read_bytes()[span.start : span.start + span.nbytes]
    assert raw == stored.view(torch.uint8).numpy().tobytes()
    with pytest.raises(KeyError):
        tensor_span(file, "layers.1.engram.nope")


def test_rows_equal_the_dequantised_table_and_count_unique_ids(tiny_dir: Path) -> None:
    file = tiny_dir / SINGLE_FILE
    with safe_open(file, framework="pt") as f:
        whole = dequantize_fp8_rows(f.get_tensor(TABLE), f.get_tensor(SCALE), torch.float32)
    table = MappedEngramTable(tensor_span(file, TABLE), tensor_span(file, SCALE))
    ids = torch.tensor([[3, 3, 0], [whole.shape[0] - 1, 17, 3]])
    assert table.rows_read == 0
    rows = table.rows(ids)
    assert rows.shape == (2, 3, whole.shape[1])
    assert torch.equal(rows, whole[ids])
    assert table.rows_read == 4  # 0, 3, 17, last: each unique id read once
    table.dtype = torch.bfloat16
    assert torch.equal(table.rows(ids), whole[ids].to(torch.bfloat16))
    with pytest.raises(IndexError, match="out of range"):
        table.rows(torch.tensor([whole.shape[0]]))
    assert _smaps_rss_kib(table.mapped_address()) > 0
    table.evict()
    assert _smaps_rss_kib(table.mapped_address()) == 0


def test_prefetch_reads_the_same_rows(tiny_dir: Path) -> None:
    file = tiny_dir / SINGLE_FILE
    plain = MappedEngramTable(tensor_span(file, TABLE), tensor_span(file, SCALE))
    ahead = MappedEngramTable(tensor_span(file, TABLE), tensor_span(file, SCALE), prefetch=True)
    ids = torch.randint(0, plain.shape[0], (7, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ahead.rows(ids), plain.rows(ids))
    assert ahead.rows_read == plain.rows_read == ids.unique().numel()


def test_fp8_table_needs_its_scale(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs its scale"):
        MappedEngramTable(tensor_span(tiny_dir / SINGLE_FILE, TABLE), None)


def test_mapped_load_reads_no_row_and_a_forward_reads_only_its_rows(
    tiny_dir: Path, in_memory: DeepseekV41
) -> None:
    _, mapped = load_checkpoint(tiny_dir, engram_mmap=True)
    mapped.eval()
    tables = _tables(mapped)
    assert len(tables) == 2
    # No copy of a table in the model: it is not a parameter any more.
    assert not [n for n in mapped.state_dict() if "engram.embed" in n]
    assert [n for n in in_memory.state_dict() if "engram.embed" in n]
    # After load: nothing gathered, and not one page of the mappings is resident.
    assert [t.rows_read for t in tables] == [0, 0]
    assert [_smaps_rss_kib(t.mapped_address()) for t in tables] == [0, 0]

    with torch.no_grad():
        got = mapped(IDS)
        want = in_memory(IDS)
    assert torch.equal(got, want)
    layers = [b.layer_id for b in mapped.blocks if b.engram is not None]
    unique = [mapped.engram_rows(IDS, 0, len(IDS), l).unique().numel() for l in layers]
    assert [t.rows_read for t in tables] == unique
    assert all(_smaps_rss_kib(t.mapped_address()) > 0 for t in tables)
    with pytest.raises(ValueError, match="memory-mapped"):
        save_checkpoint(mapped, mapped.config, tiny_dir.parent / "resaved")


def test_mapped_bfloat16_load_equals_in_memory(tiny_dir: Path) -> None:
    _, a = load_checkpoint(tiny_dir, dtype=torch.bfloat16, engram_mmap=False)
    _, b = load_checkpoint(tiny_dir, dtype=torch.bfloat16, engram_mmap=True)
    with torch.no_grad():
        assert torch.equal(a.eval()(IDS[:6]), b.eval()(IDS[:6]))


def test_default_maps_only_large_tables(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, in_memory: DeepseekV41
) -> None:
    _, small = load_checkpoint(tiny_dir)  # the tiny tables are far below the threshold
    assert _tables(small) == [None, None]
    monkeypatch.setattr(checkpoint, "ENGRAM_MMAP_MIN_BYTES", 0)
    _, large = load_checkpoint(tiny_dir)
    assert all(isinstance(t, MappedEngramTable) for t in _tables(large))
    # A copy of the model shares the read-only mapping and computes the same.
    twin = copy.deepcopy(large)
    assert _tables(twin)[0] is _tables(large)[0]
    with torch.no_grad():
        assert torch.equal(twin.eval()(IDS[:5]), in_memory(IDS[:5]))


def test_engine_serves_a_mapped_checkpoint_like_the_in_memory_one(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paged runner's path (``build_engine`` as ``serve`` calls it, the default
    ``engram_mmap``) with mapped tables streams the in-memory load's tokens."""
    from engine.api.request import Request
    from engine.api.sampling_params import SamplingParams
    from engine.config import EngineConfig
    from engine.loader.builder import build_engine

    def stream(threshold: int) -> tuple[list[int], list]:
        monkeypatch.setattr(checkpoint, "ENGRAM_MMAP_MIN_BYTES", threshold)
        engine = build_engine(EngineConfig(kv_cache_bytes=8 << 20, max_num_seqs=1), tiny_dir)
        tables = _tables(engine.runner.model)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        engine.add_request(Request("r", IDS.tolist(), params))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += [t for c in out.outputs for t in c.token_ids]
        engine.close()
        return tokens, tables

    mapped, tables = stream(0)
    in_memory, _ = stream(1 << 62)
    assert len(mapped) == 4 and mapped == in_memory
    assert tables and all(t.rows_read > 0 for t in tables)
