"""``ServerMetrics``: exposed names, histogram values and the engine-stats mapping.

Oracles: hand-computed values, read back through prometheus_client's text
parser (a second code path from the exposition writer).
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from engine.core.llm_engine import EngineCounters, EngineStats
from kvstore.stats import KVStats, SSDStats
from server.metrics.metrics import ServerMetrics

MODEL = "deepseek-flash"

# The public interface (docs/metrics.md), written out by hand.
HISTOGRAMS = {
    "flashserve:time_to_first_token_seconds",
    "flashserve:inter_token_latency_seconds",
    "flashserve:e2e_request_latency_seconds",
    "flashserve:request_queue_time_seconds",
    "flashserve:disagg_prefill_seconds",
    "flashserve:disagg_handover_seconds",
    "flashserve:disagg_handover_bytes",
}
GAUGES = {
    "flashserve:num_requests_running",
    "flashserve:num_requests_waiting",
    "flashserve:kv_cache_usage_perc",
    "flashserve:kv_ssd_bytes",
    "flashserve:server_role",
}
COUNTERS = {
    "flashserve:prefix_cache_queries_total",
    "flashserve:prefix_cache_hits_total",
    "flashserve:prompt_tokens_total",
    "flashserve:generation_tokens_total",
    "flashserve:prompt_cache_hit_tokens_total",
    "flashserve:replay_tokens_total",
    "flashserve:request_success_total",
    "flashserve:preemptions_total",
    "flashserve:kv_ssd_checksum_failures_total",
    "flashserve:kv_ssd_write_errors_total",
    "flashserve:disagg_fallbacks_total",
    "flashserve:disagg_published_pages_total",
    "flashserve:disagg_published_bytes_total",
    "flashserve:cost_total",
    "flashserve:cost_saved_by_cache_total",
    "flashserve:spec_decode_num_drafts_total",
    "flashserve:spec_decode_num_draft_tokens_total",
    "flashserve:spec_decode_num_accepted_tokens_total",
    "flashserve:spec_decode_num_accepted_tokens_per_pos_total",
}
ENGINE_NAMES = {
    "flashserve:num_requests_running",
    "flashserve:num_requests_waiting",
    "flashserve:kv_cache_usage_perc",
    "flashserve:kv_ssd_bytes",
} | {n for n in COUNTERS if not n.startswith(("flashserve:disagg_", "flashserve:cost"))}


def samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset], float]:
    """(sample name, labels) -> value, parsed back from the exposition text."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def type_lines(metrics: ServerMetrics) -> dict[str, str]:
    """Metric name -> type, from the ``# TYPE`` lines as a scraper reads them."""
    out = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            out[name] = kind
    return out


def test_exposed_names_and_types_are_the_documented_ones() -> None:
    types = type_lines(ServerMetrics(MODEL))
    created = {n for n in types if n.endswith("_created")}  # prometheus_client's own
    assert {n for n, t in types.items() if t == "histogram"} == HISTOGRAMS
    assert {n for n, t in types.items() if t == "counter"} == COUNTERS
    assert {n for n, t in types.items() if t == "gauge"} - created == GAUGES


@pytest.mark.parametrize("role", ["both", "prefill", "decode", "router"])
def test_each_role_says_what_it_is_and_a_router_has_no_engine_series(role: str) -> None:
    metrics = ServerMetrics(MODEL, role=role)
    types = type_lines(metrics)
    for r in ("both", "prefill", "decode", "router"):
        assert value(metrics, "flashserve:server_role", role=r) == (r == role)
    for reason in ("prefill_timeout", "prefill_error", "missing_pages"):
        assert value(metrics, "flashserve:disagg_fallbacks_total", reason=reason) == 0
    engine_names = ENGINE_NAMES & set(types)
    assert engine_names == (set() if role == "router" else ENGINE_NAMES)


def test_disagg_histograms_and_counters_read_back() -> None:
    metrics = ServerMetrics(MODEL, role="decode")
    d = metrics.disagg
    d.handover_bytes.observe(4 * 34272)
    d.handover_bytes.observe(0)
    d.handover_seconds.observe(0.004)
    d.fallback("missing_pages")
    assert value(metrics, "flashserve:disagg_handover_bytes_sum") == 4 * 34272
    assert value(metrics, "flashserve:disagg_handover_bytes_count") == 2
    assert value(metrics, "flashserve:disagg_handover_bytes_bucket", le="16384.0") == 1
    assert value(metrics, "flashserve:disagg_handover_bytes_bucket", le="262144.0") == 2
    assert value(metrics, "flashserve:disagg_handover_seconds_bucket", le="0.0025") == 0
    assert value(metrics, "flashserve:disagg_handover_seconds_bucket", le="0.005") == 1
    assert value(metrics, "flashserve:disagg_fallbacks_total", reason="missing_pages") == 1


def test_every_series_exists_at_zero_before_any_traffic() -> None:
    got = samples(ServerMetrics(MODEL))
    for tier in ("device", "ssd"):
        for name in (
            "flashserve:kv_cache_usage_perc",
            "flashserve:prefix_cache_queries_total",
            "flashserve:prefix_cache_hits_total",
        ):
            key = (name, frozenset({"model_name": MODEL, "tier": tier}.items()))
            assert got[key] == 0
    for reason in ("stop", "length", "abort"):
        key = (
            "flashserve:request_success_total",
            frozenset({"model_name": MODEL, "finished_reason": reason}.items()),
        )
        assert got[key] == 0
    assert got[("flashserve:num_requests_waiting", frozenset({"model_name": MODEL}.items()))] == 0


def test_observe_request_fills_the_latency_histograms() -> None:
    m = ServerMetrics(MODEL)
    # Arrival 10.0, scheduled 10.5, token steps at 11, 11.015, 11.015 (two tokens
    # in one step), 11.3; finished at 11.4.
    m.observe_request(
        arrival=10.0, first_scheduled=10.5, token_times=[11.0, 11.015, 11.015, 11.3], finished=11.4
    )
    ttft = "flashserve:time_to_first_token_seconds"
    assert value(m, ttft + "_count") == 1
    assert value(m, ttft + "_sum") == pytest.approx(1.0)
    assert value(m, ttft + "_bucket", le="0.5") == 0
    assert value(m, ttft + "_bucket", le="1.0") == 1
    itl = "flashserve:inter_token_latency_seconds"
    assert value(m, itl + "_count") == 2  # 0.015 and 0.285: the repeated step counts once
    assert value(m, itl + "_sum") == pytest.approx(0.3)
    assert value(m, itl + "_bucket", le="0.01") == 0
    assert value(m, itl + "_bucket", le="0.02") == 1
    assert value(m, itl + "_bucket", le="0.15") == 1
    assert value(m, itl + "_bucket", le="0.3") == 2
    e2e = "flashserve:e2e_request_latency_seconds"
    assert value(m, e2e + "_sum") == pytest.approx(1.4)
    assert value(m, e2e + "_bucket", le="1.0") == 0
    assert value(m, e2e + "_bucket", le="2.5") == 1
    queue = "flashserve:request_queue_time_seconds"
    assert value(m, queue + "_sum") == pytest.approx(0.5)
    assert value(m, queue + "_bucket", le="0.25") == 0
    assert value(m, queue + "_bucket", le="0.5") == 1


def test_a_routed_request_counts_ttft_and_e2e_from_the_routers_arrival() -> None:
    m = ServerMetrics(MODEL, role="decode")
    # The router got it at 6.0 (a 4 s prefill call); here it arrived at 10.0.
    m.observe_request(
        arrival=10.0,
        first_scheduled=10.5,
        token_times=[11.0, 11.3],
        finished=11.4,
        client_arrival=6.0,
    )
    assert value(m, "flashserve:time_to_first_token_seconds_sum") == pytest.approx(5.0)
    assert value(m, "flashserve:e2e_request_latency_seconds_sum") == pytest.approx(5.4)
    assert value(m, "flashserve:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(m, "flashserve:inter_token_latency_seconds_sum") == pytest.approx(0.3)


def test_request_that_never_ran_counts_only_end_to_end() -> None:
    m = ServerMetrics(MODEL)
    m.observe_request(arrival=0.0, first_scheduled=None, token_times=[], finished=3.0)
    assert value(m, "flashserve:e2e_request_latency_seconds_count") == 1
    assert value(m, "flashserve:time_to_first_token_seconds_count") == 0
    assert value(m, "flashserve:request_queue_time_seconds_count") == 0
    assert value(m, "flashserve:inter_token_latency_seconds_count") == 0


def engine_stats() -> EngineStats:
    kv = KVStats(
        page_tokens=64,
        device_pages_total=200,
        device_pages_in_use=150,
        device_pages_cached=30,
        device_pages_free=20,
        lookups=9,
        lookup_tokens=5000,
        device_hit_tokens=1280,
        ssd_lookup_pages=40,
        ssd_hit_tokens=1920,
        ssd=SSDStats(
            enabled=True,
            bytes=3_000_000,
            budget_bytes=12_000_000,
            checksum_failures=2,
            write_errors=1,
        ),
    )
    counters = EngineCounters(
        prompt_tokens=7000,
        generation_tokens=900,
        prompt_cache_hit_tokens=3200,
        replay_tokens=256,
        finished={"stop": 5, "length": 2},
    )
    return EngineStats(running=3, waiting=4, preemptions=6, kv=kv, counters=counters)


def test_engine_stats_map_to_gauges_and_counters() -> None:
    m = ServerMetrics(MODEL)
    m.set_engine_stats(engine_stats())
    assert value(m, "flashserve:num_requests_running") == 3
    assert value(m, "flashserve:num_requests_waiting") == 4
    assert value(m, "flashserve:kv_cache_usage_perc", tier="device") == 0.75  # 150 / 200
    assert value(m, "flashserve:kv_cache_usage_perc", tier="ssd") == 0.25  # 3 MB / 12 MB
    assert value(m, "flashserve:kv_ssd_bytes") == 3_000_000
    assert value(m, "flashserve:prefix_cache_queries_total", tier="device") == 5000
    assert value(m, "flashserve:prefix_cache_queries_total", tier="ssd") == 40 * 64
    assert value(m, "flashserve:prefix_cache_hits_total", tier="device") == 1280
    assert value(m, "flashserve:prefix_cache_hits_total", tier="ssd") == 1920
    assert value(m, "flashserve:prompt_tokens_total") == 7000
    assert value(m, "flashserve:generation_tokens_total") == 900
    assert value(m, "flashserve:prompt_cache_hit_tokens_total") == 3200
    assert value(m, "flashserve:replay_tokens_total") == 256
    assert value(m, "flashserve:request_success_total", finished_reason="stop") == 5
    assert value(m, "flashserve:request_success_total", finished_reason="length") == 2
    assert value(m, "flashserve:request_success_total", finished_reason="abort") == 0
    assert value(m, "flashserve:preemptions_total") == 6
    assert value(m, "flashserve:kv_ssd_checksum_failures_total") == 2
    assert value(m, "flashserve:kv_ssd_write_errors_total") == 1


def spec_stats() -> EngineStats:
    """Three verify steps of K = 3 drafts: 2, 0 and 3 accepted, plus one draft of 1
    token (cut by max_tokens), accepted: 4 drafts, 10 draft tokens, 6 accepted."""
    stats = engine_stats()
    c = stats.counters
    c.spec_drafts, c.spec_draft_tokens, c.spec_accepted_tokens = 4, 10, 6
    # Position 0: drafts 1, 3, 4; position 1: drafts 1, 3; position 2: draft 3.
    c.spec_accepted_per_pos = [3, 2, 1]
    return stats


def test_speculative_decoding_counters_by_both_names() -> None:
    m = ServerMetrics(MODEL, vllm_aliases=True)
    m.set_engine_stats(spec_stats())
    for prefix in ("flashserve:", "vllm:"):
        assert value(m, prefix + "spec_decode_num_drafts_total") == 4
        assert value(m, prefix + "spec_decode_num_draft_tokens_total") == 10
        assert value(m, prefix + "spec_decode_num_accepted_tokens_total") == 6
        per_pos = {
            dict(labels)["position"]: v
            for (name, labels), v in samples(m).items()
            if name == prefix + "spec_decode_num_accepted_tokens_per_pos_total"
        }
        assert per_pos == {"0": 3, "1": 2, "2": 1}
    types = type_lines(m)
    assert types["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == "counter"
    # The dashboard's two figures from these: acceptance rate and mean acceptance length.
    assert value(m, "flashserve:spec_decode_num_accepted_tokens_total") / value(
        m, "flashserve:spec_decode_num_draft_tokens_total"
    ) == pytest.approx(0.6)
    assert 1 + value(m, "flashserve:spec_decode_num_accepted_tokens_total") / value(
        m, "flashserve:spec_decode_num_drafts_total"
    ) == pytest.approx(2.5)


def test_without_speculation_the_counters_are_zero_and_no_position_exists() -> None:
    m = ServerMetrics(MODEL, vllm_aliases=True)
    assert value(m, "flashserve:spec_decode_num_drafts_total") == 0  # before any snapshot
    m.set_engine_stats(engine_stats())
    assert value(m, "flashserve:spec_decode_num_drafts_total") == 0
    assert value(m, "vllm:spec_decode_num_accepted_tokens_total") == 0
    names = {name for name, _ in samples(m)}
    assert "flashserve:spec_decode_num_accepted_tokens_per_pos_total" not in names
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" not in names


def test_the_latest_snapshot_wins() -> None:
    m = ServerMetrics(MODEL)
    first = engine_stats()
    m.set_engine_stats(first)
    later = engine_stats()
    later.counters.generation_tokens = 1500
    later.running = 0
    m.set_engine_stats(later)
    assert value(m, "flashserve:generation_tokens_total") == 1500
    assert value(m, "flashserve:num_requests_running") == 0


def test_ssd_usage_without_a_persistent_tier_is_zero() -> None:
    stats = engine_stats()
    stats.kv.ssd = SSDStats()  # no --kv-dir
    m = ServerMetrics(MODEL)
    m.set_engine_stats(stats)
    assert value(m, "flashserve:kv_cache_usage_perc", tier="ssd") == 0
    assert value(m, "flashserve:kv_ssd_bytes") == 0


def test_two_instances_do_not_collide_and_a_shared_registry_refuses_twins() -> None:
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.observe_request(arrival=0.0, first_scheduled=0.0, token_times=[1.0], finished=1.0)
    assert b.render().count(b"flashserve:time_to_first_token_seconds_count") == 1
    assert b'model_name="a"' not in b.render()
    registry = CollectorRegistry()
    ServerMetrics("a", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        ServerMetrics("b", registry=registry)


def test_vllm_aliases_carry_the_same_numbers() -> None:
    """The names the Gateway API inference extension's endpoint picker scrapes."""
    m = ServerMetrics(MODEL, vllm_aliases=True)
    m.set_engine_stats(engine_stats())
    m.observe_request(arrival=0.0, first_scheduled=0.5, token_times=[1.0, 1.25], finished=2.0)
    assert value(m, "vllm:num_requests_running") == 3
    assert value(m, "vllm:num_requests_waiting") == 4
    assert value(m, "vllm:kv_cache_usage_perc") == 0.75  # the device tier
    assert value(m, "vllm:gpu_cache_usage_perc") == 0.75
    assert value(m, "vllm:prompt_tokens_total") == 7000
    assert value(m, "vllm:generation_tokens_total") == 900
    assert value(m, "vllm:num_preemptions_total") == 6
    assert value(m, "vllm:prefix_cache_queries_total") == 5000
    assert value(m, "vllm:prefix_cache_hits_total") == 1280
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 5
    assert value(m, "vllm:cache_config_info", block_size="64", num_gpu_blocks="200") == 1
    lora = {k: v for k, v in samples(m).items() if k[0] == "vllm:lora_requests_info"}
    ((_, labels),) = lora
    assert dict(labels) == {
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    for name, expected in (
        ("time_to_first_token_seconds", 1.0),
        ("inter_token_latency_seconds", 0.25),
        ("e2e_request_latency_seconds", 2.0),
        ("request_queue_time_seconds", 0.5),
    ):
        assert value(m, f"vllm:{name}_sum") == value(m, f"flashserve:{name}_sum") == expected
    plain = type_lines(ServerMetrics(MODEL))
    assert not [n for n in plain if n.startswith("vllm:")]  # off by default


def test_cost_counters_add_each_request_by_kind() -> None:
    from server.openai.pricing import Cost

    m = ServerMetrics(MODEL)
    assert value(m, "flashserve:cost_total", kind="output") == 0
    m.add_cost(Cost("USD", 0.25, 1.5, 2.0, 0.75, off_peak=False))
    m.add_cost(Cost("USD", 0.125, 0.5, 1.0, 0.25, off_peak=True))
    assert value(m, "flashserve:cost_total", kind="cache_hit_input") == 0.375
    assert value(m, "flashserve:cost_total", kind="cache_miss_input") == 2.0
    assert value(m, "flashserve:cost_total", kind="output") == 3.0
    assert value(m, "flashserve:cost_saved_by_cache_total") == 1.0
