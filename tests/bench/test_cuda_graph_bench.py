"""``bench/cuda_graph_bench.py`` on the CPU with the recording backend: the script's
bookkeeping (two engines, decode-step timing, the token comparison) without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cuda_graph_bench_runs_on_cpu_with_recorded_graphs(tmp_path: Path) -> None:
    out = tmp_path / "graphs.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "cuda_graph_bench.py"),
        *("--device", "cpu", "--backend", "record", "--quantization", "none"),
        *("--batches", "2", "--steps", "4", "--json", str(out)),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2 and row["requests_with_equal_tokens"] == 2
    assert row["graph_steps"] == 3  # 4 tokens: the prefill's, then 3 decode steps
    assert row["capture_seconds"] > 0 and row["eager_step_ms"] > 0 and row["graph_step_ms"] > 0
