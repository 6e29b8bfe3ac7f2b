"""bench.serving.metrics against hand-computed values from synthetic records.

Times are binary fractions (1/8 s, ...) so every expected number below is exact
or a short decimal worked out by hand in the comments.
"""

from __future__ import annotations

import math

import pytest

from bench.serving.client import RequestRecord
from bench.serving.metrics import (
    cache_hit_by_turn,
    compute_metrics,
    counter_deltas,
    parse_goodput,
    server_counters,
    stats_ms,
    tpot,
)


def _rec(turn: int, **kw) -> RequestRecord:
    base = dict(session_id=0, turn=turn, group=0, prompt_len=0, max_tokens=16, success=True)
    return RequestRecord(**(base | kw))


def records() -> list[RequestRecord]:
    return [
        # TPOT = (1.125 - 0.125) / (9 - 1) = 0.125 s; 8 gaps of 125 ms.
        _rec(
            0,
            ttft=0.125,
            latency=1.125,
            output_tokens=9,
            prompt_len=90,
            prompt_tokens=100,
            cache_hit_tokens=64,
            itl=[0.125] * 8,
        ),
        # TPOT = (0.625 - 0.375) / (5 - 1) = 0.0625 s; 4 gaps of 62.5 ms.
        _rec(
            1,
            ttft=0.375,
            latency=0.625,
            output_tokens=5,
            prompt_len=190,
            prompt_tokens=200,
            cache_hit_tokens=150,
            itl=[0.0625] * 4,
        ),
        # One output token: no TPOT; no usage, so the client's prompt_len counts.
        _rec(2, ttft=0.25, latency=0.25, output_tokens=1, prompt_len=50),
        # Failed: counts for nothing but `failed`, whatever its fields say.
        _rec(
            1,
            success=False,
            ttft=9.0,
            latency=9.0,
            output_tokens=7,
            prompt_tokens=1000,
            cache_hit_tokens=1000,
        ),
    ]


def test_tpot_formula() -> None:
    r = records()
    assert tpot(r[0]) == 0.125
    assert tpot(r[1]) == 0.0625
    assert tpot(r[2]) is None


def test_counts_and_throughputs() -> None:
    m = compute_metrics(records(), duration_s=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 100 + 200 + 50
    assert m["total_output_tokens"] == 9 + 5 + 1
    assert m["request_throughput"] == 3 / 2.0
    assert m["output_throughput"] == 15 / 2.0
    assert m["total_token_throughput"] == (350 + 15) / 2.0
    assert "request_goodput" not in m


def test_latency_statistics() -> None:
    m = compute_metrics(records(), duration_s=2.0)
    # TTFT ms [125, 375, 250]; sorted [125, 250, 375]: p90 at rank 1.8, p99 at rank 1.98.
    assert m["mean_ttft_ms"] == 250.0
    assert m["median_ttft_ms"] == 250.0
    assert m["std_ttft_ms"] == pytest.approx(125 * math.sqrt(2 / 3))
    assert m["p90_ttft_ms"] == pytest.approx(250 + 0.8 * 125)
    assert m["p99_ttft_ms"] == pytest.approx(250 + 0.98 * 125)
    # TPOT ms [125, 62.5] (the one-token request has none).
    assert m["mean_tpot_ms"] == 93.75
    assert m["median_tpot_ms"] == 93.75
    assert m["p90_tpot_ms"] == pytest.approx(62.5 + 0.9 * 62.5)
    assert m["p99_tpot_ms"] == pytest.approx(62.5 + 0.99 * 62.5)
    # ITL pooled: 8 x 125 ms and 4 x 62.5 ms.
    assert m["mean_itl_ms"] == pytest.approx((8 * 125 + 4 * 62.5) / 12)
    assert m["median_itl_ms"] == 125.0
    # E2EL ms [1125, 625, 250].
    assert m["mean_e2el_ms"] == pytest.approx(2000 / 3)
    assert m["median_e2el_ms"] == 625.0
    assert m["p90_e2el_ms"] == pytest.approx(625 + 0.8 * 500)
    assert m["p99_e2el_ms"] == pytest.approx(625 + 0.98 * 500)


def test_goodput() -> None:
    # ttft<=250 and tpot<=62.5: the first fails TPOT (125), the second TTFT (375); the
    # third meets TTFT exactly and has TPOT 0 (one token).
    m = compute_metrics(records(), 2.0, parse_goodput(["ttft:250", "tpot:62.5"]))
    assert m["good_completed"] == 1
    assert m["request_goodput"] == 0.5
    m = compute_metrics(records(), 2.0, {"e2el": 625.0})
    assert m["good_completed"] == 2  # 625 and 250 ms; not 1125
    assert m["request_goodput"] == 1.0


def test_cache_hit_shares() -> None:
    m = compute_metrics(records(), 2.0)
    assert m["mean_cache_hit_share"] == pytest.approx((64 / 100 + 150 / 200) / 2)
    assert m["total_cache_hit_tokens"] == 214
    assert m["cache_hit_token_share"] == pytest.approx(214 / 300)
    assert m["cache_hit_share_by_turn"] == {"0": 0.64, "1": 0.75}
    assert cache_hit_by_turn(records()) == {0: 0.64, 1: 0.75}


def test_empty_and_all_failed() -> None:
    m = compute_metrics([_rec(0, success=False)], 4.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["request_throughput"] == 0.0 and m["mean_ttft_ms"] == 0.0
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


def test_stats_percentile_keys() -> None:
    # 1..5 ms: p90 = 4 + 0.6 * 1 (rank 3.6), p50 = 3.
    s = stats_ms("x", [0.001, 0.002, 0.003, 0.004, 0.005], percentiles=(50, 90))
    assert s["p50_x_ms"] == pytest.approx(3.0)
    assert s["p90_x_ms"] == pytest.approx(4.6)
    assert s["mean_x_ms"] == pytest.approx(3.0)


def test_parse_goodput_rejects_bad_items() -> None:
    assert parse_goodput(["e2el:1000"]) == {"e2el": 1000.0}
    for bad in ("ttft", "foo:10", "tpot:0", "ttft:x"):
        with pytest.raises(ValueError):
            parse_goodput([bad])


SCRAPE = """\
# HELP flashserve:replay_tokens_total Rows re-run.
# TYPE flashserve:replay_tokens_total counter
flashserve:replay_tokens_total{model_name="m"} 120.0
flashserve:replay_tokens_created{model_name="m"} 1.7e9
# HELP flashserve:prefix_cache_hits_total Hits.
# TYPE flashserve:prefix_cache_hits_total counter
flashserve:prefix_cache_hits_total{model_name="m",tier="device"} 64.0
flashserve:prefix_cache_hits_total{model_name="m",tier="ssd"} 128.0
# HELP flashserve:num_requests_running Running.
# TYPE flashserve:num_requests_running gauge
flashserve:num_requests_running{model_name="m"} 3.0
# HELP other_total Not ours.
# TYPE other_total counter
other_total 5.0
"""


def test_server_counters_from_prometheus_text() -> None:
    assert server_counters(SCRAPE) == {
        "replay_tokens": 120.0,
        "prefix_cache_hits{tier=device}": 64.0,
        "prefix_cache_hits{tier=ssd}": 128.0,
    }
    later = SCRAPE.replace("} 120.0", "} 150.0").replace("} 128.0", "} 128.5")
    deltas = counter_deltas(server_counters(SCRAPE), server_counters(later) | {"preemptions": 2})
    assert deltas == {
        "replay_tokens": 30.0,
        "prefix_cache_hits{tier=device}": 0.0,
        "prefix_cache_hits{tier=ssd}": 0.5,
        "preemptions": 2.0,
    }


def test_server_counters_read_the_servers_own_names() -> None:
    # The server's real exposition (a second code path: prometheus_client's writer).
    from server.metrics.metrics import ServerMetrics

    counters = server_counters(ServerMetrics("flash").render().decode())
    assert counters["replay_tokens"] == 0.0
    assert counters["preemptions"] == 0.0
    assert counters["prompt_cache_hit_tokens"] == 0.0
