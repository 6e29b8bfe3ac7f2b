"""``bench/gpu_smoke.py`` on the CPU: the device side is the CPU again, so every token
and every logit must agree exactly, and the kernel step says it was skipped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_smoke_runs_cpu_against_itself(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu_smoke.py"),
            "--device",
            "cpu",
            "--steps",
            "3",
            "--prompt-lengths",
            "7,40",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stdout
    result = json.loads(out.read_text())
    assert result["kernels"] == {"ran": False}
    assert result["cuda_graphs"] == {"ran": False}
    rows = result["engine"]["rows"]
    assert [r["prompt_tokens"] for r in rows] == [7, 40]
    for row in rows:
        assert row["tokens"] == 3
        for pair in (
            "device_reference_vs_cpu",
            "device_triton_vs_cpu",
            "device_triton_vs_device_reference",
        ):
            assert row[pair]["tokens_equal"] == 3, pair
            assert row[pair]["first_step_max_dlogit"] == 0.0, pair
            assert row[pair]["first_diverging_step"] is None, pair
