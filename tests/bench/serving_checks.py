"""Recompute a run document's metrics from its raw records, independently of numpy.

Shared by the CLI test (stand-in server) and the end-to-end test (real server).
Percentiles use ``statistics.quantiles(method="inclusive")``, which is the same
linear interpolation numpy's default uses, computed by a different code path.
"""

from __future__ import annotations

import statistics
from typing import Any

import pytest


def _pct(values: list[float], p: int) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def check_run_arithmetic(doc: dict[str, Any]) -> None:
    m = doc["metrics"]
    records = doc["records"]
    done = [r for r in records if r["success"]]
    assert m["completed"] == len(done) and m["failed"] == len(records) - len(done)
    duration = m["duration"]
    out_tokens = sum(r["output_tokens"] for r in done)
    in_tokens = sum(
        r["prompt_tokens"] if r["prompt_tokens"] is not None else r["prompt_len"] for r in done
    )
    assert m["total_output_tokens"] == out_tokens
    assert m["total_input_tokens"] == in_tokens
    assert m["request_throughput"] == pytest.approx(len(done) / duration)
    assert m["output_throughput"] == pytest.approx(out_tokens / duration)
    assert m["total_token_throughput"] == pytest.approx((in_tokens + out_tokens) / duration)
    # The wall clock covers every request.
    assert duration >= max(r["start"] + r["latency"] for r in done)

    tpots = [
        (r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) * 1e3
        for r in done
        if r["output_tokens"] > 1
    ]
    ttfts = [r["ttft"] * 1e3 for r in done]
    e2els = [r["latency"] * 1e3 for r in done]
    itls = [g * 1e3 for r in done for g in r["itl"]]
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("e2el", e2els), ("itl", itls)):
        assert values, name
        assert m[f"mean_{name}_ms"] == pytest.approx(statistics.fmean(values))
        assert m[f"median_{name}_ms"] == pytest.approx(statistics.median(values))
        assert m[f"p99_{name}_ms"] == pytest.approx(_pct(values, 99))
        assert m[f"p90_{name}_ms"] == pytest.approx(_pct(values, 90))
    for r in done:
        assert 0 < r["ttft"] <= r["latency"]
        assert sum(r["itl"]) <= r["latency"] - r["ttft"] + 1e-9

    shares = [
        r["cache_hit_tokens"] / r["prompt_tokens"]
        for r in done
        if r["cache_hit_tokens"] is not None and r["prompt_tokens"]
    ]
    if shares:
        assert m["mean_cache_hit_share"] == pytest.approx(statistics.fmean(shares))
    slos = m.get("goodput_slos_ms")
    if slos:
        good = 0
        for r in done:
            tpot = (
                (r["latency"] - r["ttft"]) / (r["output_tokens"] - 1)
                if r["output_tokens"] > 1
                else 0.0
            )
            value = {"ttft": r["ttft"], "tpot": tpot, "e2el": r["latency"]}
            good += all(value[k] * 1e3 <= v for k, v in slos.items())
        assert m["good_completed"] == good
        assert m["request_goodput"] == pytest.approx(good / duration)
