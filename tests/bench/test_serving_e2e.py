"""A very small ``flashserve bench --launch`` against the real ``flashserve serve --model tiny``.

Checks the JSON's arithmetic against its raw records, and the client's view (the
streams' usage) against the server's own counters read from /metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serving_checks import check_run_arithmetic

from flashserve.cli import main

PAGE_TOKENS = 64  # flashserve serve's default --page-tokens


@pytest.mark.timeout(300)
def test_bench_launches_tiny_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "bench",
            "--launch",
            "--launch-model",
            "tiny",
            "--workload",
            "agent",
            "--num-agents",
            "2",
            "--turns",
            "2",
            "--system-len",
            "260",
            "--task-len",
            "8",
            "--tool-result-len",
            "60",
            "--output-len",
            "4",
            "--ignore-eos",
            "--output-dir",
            str(tmp_path),
            "--no-plots",
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out + (tmp_path / "server.log").read_text()
    doc = json.loads((tmp_path / "serving.json").read_text())
    assert doc["model"] == "deepseek-flash" and "--kv-dir" in doc["server_command"]
    records = doc["records"]
    assert len(records) == 4 and all(r["success"] for r in records)
    check_run_arithmetic(doc)
    for r in records:
        # The chat template adds tokens to the client's count of the contents.
        assert r["prompt_tokens"] > r["prompt_len"]
        assert 1 <= r["output_tokens"] <= 4
        hit = r["cache_hit_tokens"]
        assert hit % PAGE_TOKENS == 0 and 0 <= hit < r["prompt_tokens"]
    # Turn 1 re-sends turn 0's prompt: at least its whole pages come from the cache.
    for session in (0, 1):
        first, second = (r for r in records if r["session_id"] == session)
        assert second["cache_hit_tokens"] >= first["prompt_tokens"] // PAGE_TOKENS * PAGE_TOKENS
    # The server's counters moved by exactly what the streams' usage reported.
    counters = doc["server_counters_delta"]
    assert counters["prompt_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert counters["generation_tokens"] == sum(r["output_tokens"] for r in records)
    assert counters["prompt_cache_hit_tokens"] == sum(r["cache_hit_tokens"] for r in records)
    assert counters["preemptions"] == 0
    assert counters["replay_tokens"] > 0  # the hits restore, which replays a window
