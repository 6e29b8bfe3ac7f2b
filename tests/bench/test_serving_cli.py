"""``flashserve bench`` end to end against the stand-in streaming server: table, JSON whose
arithmetic matches its raw records, counters from /metrics, and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serving_checks import check_run_arithmetic
from serving_fake_server import REPLAY_PER_REQUEST, FakeServer, FakeState

from flashserve.cli import main


def test_bench_cli_agent_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = FakeState(first_delay_s=0.02, gap_s=0.01)
    with FakeServer(state) as server:
        code = main(
            [
                "bench",
                "--base-url",
                server.base_url,
                "--workload",
                "agent",
                "--num-agents",
                "3",
                "--turns",
                "3",
                "--system-len",
                "300",
                "--task-len",
                "10",
                "--tool-result-len",
                "40",
                "--output-len",
                "5",
                "--goodput",
                "ttft:1000",
                "e2el:50",
                "--output-dir",
                str(tmp_path),
                "--quiet",
            ]
        )
    assert code == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out
    doc = json.loads((tmp_path / "serving.json").read_text())
    assert doc["workload"]["name"] == "agent" and doc["workload"]["num_requests"] == 9
    assert doc["arrivals"]["request_rate"] == "inf"
    assert doc["model"] == "fake-model" and len(doc["records"]) == 9
    check_run_arithmetic(doc)
    m = doc["metrics"]
    assert m["completed"] == 9 and m["total_output_tokens"] == 45
    # One chunk per token from the stand-in: 4 gaps per request.
    assert all(len(r["itl"]) == 4 for r in doc["records"])
    # The stand-in takes at least 20 + 4 x 10 ms per request: e2el:50 fails them all.
    assert m["p90_e2el_ms"] >= 60 and m["good_completed"] == 0
    assert doc["server_counters_delta"] == {
        "preemptions": 4.0,
        "replay_tokens": 9.0 * REPLAY_PER_REQUEST,
    }
    for name in ("ttft_cdf.png", "tpot_cdf.png", "cache_hit_per_turn.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_bench_cli_failure_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Nothing listens on the port: every request fails, the command says so.
    from bench.serving.launch import free_port

    code = main(
        [
            "bench",
            "--base-url",
            f"http://127.0.0.1:{free_port()}",
            "--model",
            "m",
            "--workload",
            "random",
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-dir",
            str(tmp_path),
            "--no-plots",
            "--quiet",
        ]
    )
    assert code == 1
    doc = json.loads((tmp_path / "serving.json").read_text())
    assert doc["metrics"]["failed"] == 2 and doc["server_counters_delta"] is None
    assert "ConnectError" in doc["records"][0]["error"]
    capsys.readouterr()
    # Without --model the first call is GET /v1/models: one error line, exit 1.
    code = main(["bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--quiet"])
    assert code == 1
    assert capsys.readouterr().err.startswith("flashserve bench: ConnectError")
    # A system prompt shorter than the tool definitions is a clear error too.
    assert main(["bench", "--system-len", "10", "--model", "m", "--quiet"]) == 1
    assert "too short" in capsys.readouterr().err


def test_command_line_never_records_the_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashserve.bench_cmd import _command_line
    from flashserve.cli import build_parser

    argv = ["bench", "--api-key", "sk-secret", "--workload", "random", "--api-key=sk-2"]
    args = build_parser().parse_args(argv)
    monkeypatch.setattr("sys.argv", ["flashserve", *argv])
    line = _command_line(args)
    assert line == "flashserve bench --api-key '***' --workload random '--api-key=***'"
    monkeypatch.setattr("sys.argv", ["pytest"])
    line = _command_line(args)
    assert "sk-" not in line and "workload=random" in line
