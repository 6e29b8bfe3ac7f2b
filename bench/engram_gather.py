"""Per-step cost of gathering Engram rows from a memory-mapped FP8 table.

A decode step of the official config at batch ``--batch`` reads, per Engram
layer, ``n_orders * n_heads`` = 24 rows per token (3 n-gram orders x 8 heads),
each 256 FP8 bytes plus 8 E8M0 scale bytes. This script writes a synthetic
FP8_ROWS table of about ``--gib`` GiB as a safetensors file (deleted after),
maps it with ``MappedEngramTable`` and times, per step, both layers' gathers
(unique ids, fancy indexing on the mapping, dequantise, cast to bf16):

- warm: every page of the file is mapped (a host whose RAM holds the tables,
  after they were first read);
- cold: before each step the mapping's pages are unmapped (MADV_DONTNEED) and
  dropped from the page cache (POSIX_FADV_DONTNEED), so every row is a page
  fault served by the disk;
- ``*_prefetch``: with ``MappedEngramTable.prefetch`` (MADV_WILLNEED on every
  page of the step before the gather);
- ``*_bytes_only``: the host half alone (unique ids, fancy-indexed copy of the
  stored bytes), without the dequantisation that a GPU run does on the device.

    .venv/bin/python bench/engram_gather.py        # writes bench/results/engram_gather.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.model.deepseek_v41.engram_table import MappedEngramTable, tensor_span  # noqa: E402

HEAD_DIM = 256  # official engram_head_dim
ROWS_PER_TOKEN = 24  # 3 orders x 8 heads, per Engram layer
ENGRAM_LAYERS = 2
CHUNK_ROWS = 1 << 18


def write_table(path: Path, rows: int, seed: int = 0) -> None:
    """``table.weight`` F8_E4M3 [rows, 256] and ``table.scale`` F8_E8M0 [rows, 8], streamed."""
    weight_bytes, scale_bytes = rows * HEAD_DIM, rows * (HEAD_DIM // 32)
    header = {
        "table.weight": {
            "dtype": "F8_E4M3",
            "shape": [rows, HEAD_DIM],
            "data_offsets": [0, weight_bytes],
        },
        "table.scale": {
            "dtype": "F8_E8M0",
            "shape": [rows, HEAD_DIM // 32],
            "data_offsets": [weight_bytes, weight_bytes + scale_bytes],
        },
    }
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for start in range(0, rows, CHUNK_ROWS):
            n = min(CHUNK_ROWS, rows - start)
            # Finite E4M3 bytes (no 0x7F / 0xFF NaN): magnitudes below 0x7F.
            f.write(rng.integers(0, 0x7F, size=n * HEAD_DIM, dtype=np.uint8).tobytes())
        for start in range(0, rows, CHUNK_ROWS):
            n = min(CHUNK_ROWS, rows - start)
            f.write(rng.integers(120, 134, size=n * (HEAD_DIM // 32), dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())


def bytes_only(table: MappedEngramTable, ids: torch.Tensor) -> None:
    """The host half of ``rows``: unique ids and the fancy-indexed copy of their bytes."""
    unique = torch.unique(ids.reshape(-1), sorted=True).numpy()
    table._weight_rows[unique]
    table._scale_rows[unique]


def time_steps(
    table: MappedEngramTable,
    rows: int,
    batch: int,
    steps: int,
    *,
    cold: bool,
    full: bool,
    seed: int,
) -> list[float]:
    """Seconds per step: ``ENGRAM_LAYERS`` gathers of ``batch x 24`` uniform row ids
    (``full``: through ``rows``, dequantised to bf16; else the byte gather only)."""
    gen = torch.Generator().manual_seed(seed)
    seconds = []
    for _ in range(steps):
        ids = [torch.randint(0, rows, (batch, ROWS_PER_TOKEN), generator=gen) for _ in range(2)]
        if cold:
            table.evict()
        t0 = time.perf_counter()
        for layer_ids in ids:
            if full:
                table.rows(layer_ids)
            else:
                bytes_only(table, layer_ids)
        seconds.append(time.perf_counter() - t0)
    return seconds


def summarise(seconds: list[float], rows_per_step: int) -> dict:
    median = statistics.median(seconds)
    step_bytes = rows_per_step * (HEAD_DIM + HEAD_DIM // 32)
    return {
        "median_us_per_step": round(median * 1e6, 1),
        "p90_us_per_step": round(sorted(seconds)[int(0.9 * (len(seconds) - 1))] * 1e6, 1),
        "us_per_row": round(median * 1e6 / rows_per_step, 3),
        "stored_MB_per_s": round(step_bytes / median / 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="table size on disk")
    parser.add_argument("--batch", type=int, default=32, help="decode batch (tokens per step)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--cold-steps", type=int, default=50)
    parser.add_argument("--dir", type=Path, default=None, help="where the table is written")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/engram_gather.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = int(args.gib * 2**30) // (HEAD_DIM + HEAD_DIM // 32)
    rows_per_step = ENGRAM_LAYERS * args.batch * ROWS_PER_TOKEN
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "engram.safetensors"
        t0 = time.perf_counter()
        write_table(path, rows)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        table = MappedEngramTable(
            tensor_span(path, "table.weight"),
            tensor_span(path, "table.scale"),
            dtype=torch.bfloat16,
        )
        map_s = time.perf_counter() - t0
        time_steps(table, rows, args.batch, 5, cold=False, full=True, seed=99)  # warm-up
        table_bytes = path.stat().st_size
        # Warm: every page of the file mapped once, as after the rows were first read.
        table._weight_rows.sum(dtype=np.uint64)
        table._scale_rows.sum(dtype=np.uint64)
        timings = {
            "warm": time_steps(table, rows, args.batch, args.steps, cold=False, full=True, seed=1),
            "warm_bytes_only": time_steps(
                table, rows, args.batch, args.steps, cold=False, full=False, seed=1
            ),
            "cold": time_steps(
                table, rows, args.batch, args.cold_steps, cold=True, full=True, seed=2
            ),
            "cold_bytes_only": time_steps(
                table, rows, args.batch, args.cold_steps, cold=True, full=False, seed=3
            ),
        }
        table.prefetch = True
        timings["cold_prefetch"] = time_steps(
            table, rows, args.batch, args.cold_steps, cold=True, full=True, seed=4
        )
        table._weight_rows.sum(dtype=np.uint64)
        table._scale_rows.sum(dtype=np.uint64)
        timings["warm_prefetch"] = time_steps(
            table, rows, args.batch, args.steps, cold=False, full=True, seed=5
        )
        unique = round(table.rows_read / table.gathers * ENGRAM_LAYERS, 1)
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "table_bytes": table_bytes,
        "table_rows": rows,
        "batch": args.batch,
        "rows_per_step": rows_per_step,
        "mean_unique_rows_per_step": unique,
        "write_seconds": round(write_s, 2),
        "map_seconds": round(map_s, 6),
        **{kind: summarise(seconds, rows_per_step) for kind, seconds in timings.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
