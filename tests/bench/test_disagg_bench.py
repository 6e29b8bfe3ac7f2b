"""bench/disagg.py: the side-by-side summary and the handover read from real metric names.

Oracles: hand-computed ratios and medians; a ``ServerMetrics`` of each role
rendered by prometheus_client, so a renamed metric breaks the benchmark here.
"""

from __future__ import annotations

import httpx
import pytest

from bench import disagg
from bench.serving.launch import ServerSpec
from engine.core.llm_engine import EngineCounters, EngineStats
from kvstore.stats import KVStats, SSDStats
from server.metrics.metrics import ServerMetrics


def _metrics(ttft: float, throughput: float) -> dict[str, float]:
    keys = [k for k, _ in disagg.HEADLINE]
    out = dict.fromkeys(keys, 1.0)
    out.update(mean_ttft_ms=ttft, request_throughput=throughput)
    return out


def test_summary_takes_ratios_per_round_and_their_median() -> None:
    runs = [
        {"colocated": {"metrics": _metrics(100, 1.0)}, "split": {"metrics": _metrics(50, 1.5)}},
        {"colocated": {"metrics": _metrics(200, 2.0)}, "split": {"metrics": _metrics(300, 1.0)}},
        {"colocated": {"metrics": _metrics(400, 1.0)}, "split": {"metrics": _metrics(200, 1.2)}},
    ]
    s = disagg._summary(runs)
    assert s["mean_ttft_ms"]["ratio_per_round"] == [0.5, 1.5, 0.5]
    assert s["mean_ttft_ms"]["ratio_median"] == 0.5
    assert (s["mean_ttft_ms"]["base_median"], s["mean_ttft_ms"]["other_median"]) == (200, 200)
    assert s["request_throughput"]["ratio_per_round"] == [1.5, 0.5, 1.2]
    assert s["request_throughput"]["ratio_median"] == pytest.approx(1.2)
    table = disagg._table(s)
    assert "| mean TTFT (ms) | 200 | 200 | 0.50 / 1.50 / 0.50 | 0.50 |" in table
    assert "| requests/s | 1 | 1.2 | 1.50 / 0.50 / 1.20 | 1.20 |" in table


def test_handover_reads_the_decode_and_router_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    decode = ServerMetrics("deepseek-flash", role="decode")
    decode.set_engine_stats(
        EngineStats(
            running=0,
            waiting=0,
            preemptions=0,
            kv=KVStats(page_tokens=64, ssd_hit_tokens=512, ssd=SSDStats(enabled=True)),
            counters=EngineCounters(),
        )
    )
    for seconds in (0.01, 0.03):
        decode.disagg.handover_seconds.observe(seconds)
        decode.disagg.handover_bytes.observe(4 * 34272)
    decode.disagg.fallback("missing_pages")
    router = ServerMetrics("deepseek-flash", role="router")
    router.disagg.prefill_seconds.observe(0.2)
    router.disagg.fallback("prefill_error")
    texts = {"http://d/metrics": decode.render(), "http://r/metrics": router.render()}
    monkeypatch.setattr(
        disagg.httpx, "get", lambda url, timeout: httpx.Response(200, content=texts[url])
    )
    h = disagg._handover(["http://d"], "http://r")
    assert h["handovers"] == 2
    assert h["handover_latency_mean_ms"] == pytest.approx(20.0)
    assert h["handover_bytes_per_token"] == pytest.approx(8 * 34272 / 512)
    assert h["prefill_call_mean_ms"] == pytest.approx(200.0)
    assert h["fallbacks"] == {"prefill_timeout": 0, "prefill_error": 1, "missing_pages": 1}
    both = disagg._handover(["http://d", "http://d"], "http://r")  # two decode workers: summed
    assert (both["handovers"], both["handover_bytes_total"]) == (4, 16 * 34272)
    assert both["handover_bytes_per_token"] == h["handover_bytes_per_token"]


def test_pinned_servers_run_under_taskset_with_their_thread_count() -> None:
    spec = disagg._pinned("1", 1, "tiny", ["--role", "decode"], ssd=False)
    assert isinstance(spec, ServerSpec)
    cmd = spec.command(8000, None)
    assert cmd[:3] == ["taskset", "-c", "1"] and cmd[-2:] == ["--role", "decode"]
    assert spec.env["OMP_NUM_THREADS"] == "1"
