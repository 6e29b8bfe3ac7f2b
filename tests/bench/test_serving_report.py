"""Run documents, the terminal tables, PNG plots and the ablation ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.serving.client import RequestRecord
from bench.serving.compare import (
    VARIANTS,
    Variant,
    compare_documents,
    format_compare,
    ratios,
    variant_spec,
)
from bench.serving.driver import RunResult
from bench.serving.launch import LaunchedServer, ServerSpec, free_port
from bench.serving.report import format_table, records_of, run_document, write_json, write_plots


def _records() -> list[RequestRecord]:
    out = []
    for turn in range(3):
        out.append(
            RequestRecord(
                session_id=0,
                turn=turn,
                group=0,
                prompt_len=100 * (turn + 1),
                max_tokens=4,
                start=0.5 * turn,
                success=True,
                ttft=0.25,
                itl=[0.125, 0.125, 0.125],
                latency=0.625,
                text="abcd",
                prompt_tokens=100 * (turn + 1),
                completion_tokens=4,
                cache_hit_tokens=64 * turn,
                output_tokens=4,
            )
        )
    return out


def _result(scale: float = 1.0, replay: float = 40.0) -> RunResult:
    return RunResult(
        model="m",
        records=_records(),
        duration_s=2.0 * scale,
        counters_before={"replay_tokens": 10.0, "preemptions": 0.0},
        counters_after={"replay_tokens": 10.0 + replay, "preemptions": 1.0},
    )


def test_run_document_table_and_json(tmp_path: Path) -> None:
    doc = run_document(_result(), label="default", slos_ms={"ttft": 300}, context={"x": 1})
    assert doc["x"] == 1 and doc["model"] == "m"
    assert doc["server_counters_delta"] == {"preemptions": 1.0, "replay_tokens": 40.0}
    m = doc["metrics"]
    assert m["output_throughput"] == 12 / 2.0 and m["request_goodput"] == 1.5
    # cache share by turn: 0, 64/200, 128/300
    assert m["cache_hit_share_by_turn"] == pytest.approx({"0": 0, "1": 0.32, "2": 128 / 300})
    table = format_table(doc)
    assert "Successful requests:" in table and "Request goodput (req/s):" in table
    assert "6.00" in table  # output throughput
    assert "replay_tokens:" in table and "40" in table
    assert "1: 0.32" in table
    path = tmp_path / "run.json"
    write_json(path, doc | {"rate": float("inf")})
    loaded = json.loads(path.read_text())
    assert loaded["rate"] == "inf"
    assert records_of(loaded) == _records()
    assert "(no /metrics" in format_table(doc | {"server_counters_delta": None})


def test_plots_are_pngs(tmp_path: Path) -> None:
    other = _records()
    for r in other:
        r.ttft *= 2
    paths = write_plots({"default": _records(), "no-ssd": other}, tmp_path)
    assert [p.name for p in paths] == ["ttft_cdf.png", "tpot_cdf.png", "cache_hit_per_turn.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_ratios_against_the_default() -> None:
    assert ratios({"a": 2.0, "b": 0, "c": "x", "d": 4, "e": True}, {"a": 3.0, "b": 5, "d": 1}) == {
        "a": 1.5,
        "b": None,
        "d": 0.25,
    }
    docs = {
        "default": run_document(_result(), label="default"),
        "disable-ced": run_document(_result(scale=2.0, replay=80.0), label="disable-ced"),
    }
    table = compare_documents(docs)
    assert list(table) == ["disable-ced"]
    entry = table["disable-ced"]
    # Twice the duration: half the throughput; same latencies.
    assert entry["metrics"]["output_throughput"] == 0.5
    assert entry["metrics"]["mean_ttft_ms"] == 1.0
    assert entry["server_counters_delta"]["replay_tokens"] == 2.0
    text = format_compare(docs, table)
    assert "disable-ced" in text and "0.500" in text and "replay_tokens" in text


def test_variants_and_specs() -> None:
    assert [v.label for v in VARIANTS] == ["default", "disable-ced", "kv-bf16", "no-ssd"]
    base = ServerSpec("tiny", ["--max-num-seqs", "4"])
    bf16 = variant_spec(base, Variant("kv-bf16", ("--kv-dtype", "bf16")))
    assert bf16.args == ["--max-num-seqs", "4", "--kv-dtype", "bf16"] and bf16.ssd
    assert not variant_spec(base, Variant("no-ssd", ssd=False)).ssd
    cmd = base.command(8123, Path("/tmp/kv"))
    i = cmd.index("serve")
    assert cmd[i:] == [
        "serve",
        "--model",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--kv-dir",
        "/tmp/kv",
        "--max-num-seqs",
        "4",
    ]
    assert "--kv-dir" not in base.command(8123, None)
    assert 0 < free_port() < 65536


def test_launch_reports_a_server_that_exits(tmp_path: Path) -> None:
    # An unknown flag makes the CLI exit at once: the launcher must say so, with the log.
    spec = ServerSpec("tiny", ["--no-such-flag-for-bench"])
    server = LaunchedServer(spec, tmp_path / "server.log", startup_timeout_s=60)
    with pytest.raises(RuntimeError, match="exited with code 2"):
        server.start()
    assert server.proc is None and server.kv_dir is None
    assert "usage: flashserve" in (tmp_path / "server.log").read_text()
