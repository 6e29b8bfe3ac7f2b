"""bench/packed_bench.py at its smallest: both engines decode, the packed one holds the
dense FP8 linears at a quarter of their fp32 bytes (plus 1/1024 in scales)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.packed_bench import main


def test_packed_bench_runs_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "packed.json"
    assert main(["--dtype", "float32", "--batch", "1", "--steps", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["batch"] == 1 and row["packed_ms"] > 0 and row["dequantised_ms"] > 0
    assert row["ratio"] == row["packed_ms"] / row["dequantised_ms"]
    assert row["packed_cpu_ms"] > 0 and row["cpu_ratio"] == (
        row["packed_cpu_ms"] / row["dequantised_cpu_ms"]
    )
    dense = result["dense_fp8"]
    # The tiny text model's 69 FP8 linears and its one-stage DSpark drafter's 9 (wq_a,
    # wq_b, wkv, wo_a, wo_b, the shared expert's w1/w2/w3, main_proj).
    linears = 69 + 9
    assert dense["linears"] == linears
    # E4M3 bytes + one E8M0 per 32x32 block, against 4 bytes per element.
    elements = dense["dequantised_bytes"] // 4
    assert elements < dense["bytes"] <= elements * (1 + 1 / 1024) + linears
