"""Reduce per-request records to vLLM's serving metrics (``vllm bench serve`` definitions).

- Requests that failed count for nothing but ``failed``.
- TPOT of a request = (E2EL - TTFT) / (output tokens - 1), for requests with more
  than one output token; for goodput a one-token request has TPOT 0 (as vLLM).
- ITL: every inter-chunk gap of every request, pooled.
- Throughputs divide by the benchmark's wall-clock duration: completed requests,
  output tokens, and input + output tokens.
- Goodput: completed requests meeting every SLO given (``ttft``, ``tpot``, ``e2el``
  in ms; a value equal to its SLO meets it), per second.
- Statistics: mean, median, std and percentiles with numpy's linear
  interpolation, in milliseconds; an empty list gives zeros.

Input tokens are the server's ``usage.prompt_tokens`` when it sent usage (it
includes the chat template), else the client-side count; the record keeps both.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.serving.client import RequestRecord

PERCENTILES = (90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")
SERVER_PREFIX = "flashserve:"


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput item {item!r}: expected one of {SLO_METRICS} as NAME:MS")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"goodput item {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def input_tokens(r: RequestRecord) -> int:
    return r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len


def tpot(r: RequestRecord) -> float | None:
    """Seconds per output token after the first; None with fewer than two tokens."""
    if r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def stats_ms(
    name: str, values_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES
) -> dict[str, float]:
    """mean/median/std/pXX of ``values_s`` (seconds) in ms, keyed like vLLM's JSON."""
    v = np.asarray(values_s, dtype=np.float64) * 1000.0
    empty = v.size == 0
    out = {
        f"mean_{name}_ms": 0.0 if empty else float(v.mean()),
        f"median_{name}_ms": 0.0 if empty else float(np.median(v)),
        f"std_{name}_ms": 0.0 if empty else float(v.std()),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = 0.0 if empty else float(np.percentile(v, p))
    return out


def meets_slos(r: RequestRecord, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": tpot(r) or 0.0, "e2el": r.latency}
    return all(values[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def cache_hit_share(r: RequestRecord) -> float | None:
    """Share of the request's prompt tokens served from the prefix cache."""
    if r.cache_hit_tokens is None or not r.prompt_tokens:
        return None
    return r.cache_hit_tokens / r.prompt_tokens


def cache_hit_by_turn(records: Iterable[RequestRecord]) -> dict[int, float]:
    """Mean cache-hit share of the completed requests of each turn index."""
    shares: dict[int, list[float]] = defaultdict(list)
    for r in records:
        share = cache_hit_share(r) if r.success else None
        if share is not None:
            shares[r.turn].append(share)
    return {turn: float(np.mean(v)) for turn, v in sorted(shares.items())}


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    slos_ms: dict[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> dict[str, Any]:
    """The benchmark's headline numbers from its raw records."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    done = [r for r in records if r.success]
    total_input = sum(input_tokens(r) for r in done)
    total_output = sum(r.output_tokens for r in done)
    tpots = [t for r in done if (t := tpot(r)) is not None]
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in done)
        out["goodput_slos_ms"] = dict(slos_ms)
        out["good_completed"] = good
        out["request_goodput"] = good / duration_s
    out |= stats_ms("ttft", [r.ttft for r in done], percentiles)
    out |= stats_ms("tpot", tpots, percentiles)
    out |= stats_ms("itl", [gap for r in done for gap in r.itl], percentiles)
    out |= stats_ms("e2el", [r.latency for r in done], percentiles)
    shares = [s for r in done if (s := cache_hit_share(r)) is not None]
    hits = [r for r in done if r.cache_hit_tokens is not None and r.prompt_tokens]
    out["mean_cache_hit_share"] = float(np.mean(shares)) if shares else 0.0
    # Token-weighted: the share of all prompt tokens the cache served.
    hit_prompt = sum(r.prompt_tokens or 0 for r in hits)
    out["total_cache_hit_tokens"] = sum(r.cache_hit_tokens or 0 for r in hits)
    out["cache_hit_token_share"] = out["total_cache_hit_tokens"] / hit_prompt if hits else 0.0
    out["cache_hit_share_by_turn"] = {str(t): s for t, s in cache_hit_by_turn(done).items()}
    return out


def server_counters(text: str, prefix: str = SERVER_PREFIX) -> dict[str, float]:
    """Counters of a Prometheus text scrape, summed over ``model_name``.

    Keys drop the prefix and ``_total``; other labels stay in the key, e.g.
    ``replay_tokens``, ``prefix_cache_hits{tier=ssd}``.
    """
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        if family.type != "counter" or not family.name.startswith(prefix):
            continue
        base = family.name[len(prefix) :]
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue  # the _created sample
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name"
            )
            out[f"{base}{{{labels}}}" if labels else base] += sample.value
    return dict(out)


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter gained during the run (a counter missing before counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}
