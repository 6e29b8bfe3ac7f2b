"""``bench/engram_gather.py`` on a small table: it runs, and its step size is the
official config's (2 Engram layers x 24 rows per token x the batch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_engram_gather_bench_runs_on_a_small_table(tmp_path: Path) -> None:
    out = tmp_path / "gather.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "engram_gather.py"),
            *("--gib", "0.01", "--batch", "4", "--steps", "3", "--cold-steps", "2"),
            *("--dir", str(tmp_path), "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["rows_per_step"] == 2 * 24 * 4
    assert result["table_rows"] == int(0.01 * 2**30) // 264
    assert 0 < result["mean_unique_rows_per_step"] <= 2 * 24 * 4
    for kind in ("warm", "warm_bytes_only", "cold", "cold_bytes_only", "cold_prefetch"):
        assert result[kind]["median_us_per_step"] > 0, kind
    assert list(tmp_path.iterdir()) == [out]  # the table file is deleted after
