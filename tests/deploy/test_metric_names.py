"""Every metric the dashboard, the alerts and their unit tests name is one the server exposes."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from deploy_helpers import (
    ALERTS_TEST,
    DASHBOARD,
    METRIC,
    ROOT,
    alert_rules,
    alert_test_series,
    dashboard_queries,
    exercised_scrape,
)
from prometheus_client.parser import text_string_to_metric_families

from server.metrics.disagg_metrics import ROLES


def exposed_names(scrape: str) -> set[str]:
    """Sample names (``_bucket``, ``_sum``, ``_count``, ``_total`` included) and family names."""
    names = set()
    for family in text_string_to_metric_families(scrape):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def test_dashboard_queries_name_exposed_metrics(scrape: str) -> None:
    exposed = exposed_names(scrape)
    queries = dashboard_queries()
    assert len(queries) > 15
    for where, expr in queries:
        used = set(METRIC.findall(expr))
        assert used, f"{where}: no flashserve metric in {expr!r}"
        assert used <= exposed, f"{where}: not exposed: {sorted(used - exposed)}"


def test_alert_rules_name_exposed_metrics(scrape: str) -> None:
    exposed = exposed_names(scrape)
    for rule in alert_rules():
        used = set(METRIC.findall(rule["expr"]))
        assert used, f"{rule['alert']}: no flashserve metric"
        assert used <= exposed, f"{rule['alert']}: not exposed: {sorted(used - exposed)}"


def test_alert_unit_tests_feed_exposed_metrics(scrape: str) -> None:
    """Input series of alerts_test.yaml: a renamed metric must break the unit tests too."""
    exposed = exposed_names(scrape) | {"up"}
    for series in alert_test_series():
        name = re.match(r"[A-Za-z0-9_:]+", series).group(0)
        assert name in exposed, series


def test_metric_regex_sees_histogram_suffixes_and_digits() -> None:
    expr = "rate(flashserve:e2e_request_latency_seconds_bucket{x=~'a'}[5m]) / flashserve:foo"
    assert METRIC.findall(expr) == [
        "flashserve:e2e_request_latency_seconds_bucket",
        "flashserve:foo",
    ]


def test_dashboard_shows_latency_throughput_and_kv_panels() -> None:
    exprs = [expr for _, expr in dashboard_queries()]
    joined = "\n".join(exprs)
    for quantity in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        assert re.search(
            rf"histogram_quantile\(0\.99, .*flashserve:{quantity}_seconds_bucket", joined
        )
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "generation_tokens_total",
        "prompt_tokens_total",
        "kv_cache_usage_perc",
        "replay_tokens_total",
        "preemptions_total",
        "kv_ssd_checksum_failures_total",
    ):
        assert f"flashserve:{name}" in joined, name
    # Hit rate per tier: hits over queries, both kept apart by tier.
    assert any(
        re.search(r"sum by \([^)]*tier[^)]*\) \(rate\(flashserve:prefix_cache_hits_total", e)
        and re.search(
            r"/ sum by \([^)]*tier[^)]*\) \(rate\(flashserve:prefix_cache_queries_total", e
        )
        for e in exprs
    )
    # Share of prompt tokens served from the cache.
    assert any(
        re.search(r"prompt_cache_hit_tokens_total.*\) / .*prompt_tokens_total", e) for e in exprs
    )


def row_queries(title: str) -> list[str]:
    """PromQL of the panels between the row ``title`` and the next row (by grid position)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    rows = sorted(p["gridPos"]["y"] for p in panels if p["type"] == "row")
    (top,) = [p["gridPos"]["y"] for p in panels if p["type"] == "row" and p["title"] == title]
    bottom = next((y for y in rows if y > top), float("inf"))
    return [
        t["expr"]
        for p in panels
        if p["type"] != "row" and top < p["gridPos"]["y"] < bottom
        for t in p["targets"]
    ]


def test_dashboard_shows_disaggregated_serving() -> None:
    """The split-deployment row: handover latency and bytes, fallbacks, prefill calls,
    publishing."""
    exprs = row_queries("Disaggregated serving")
    joined = "\n".join(exprs)
    for q in ("0.5", "0.99"):
        assert re.search(
            rf"histogram_quantile\({q}, .*flashserve:disagg_handover_seconds_bucket", joined
        ), q
    assert re.search(
        r"histogram_quantile\(0\.99, .*flashserve:disagg_prefill_seconds_bucket", joined
    )
    # Bytes per handed-over prompt: rate of the sum over rate of the count.
    per_prompt = (
        r"rate\(flashserve:disagg_handover_bytes_sum.*\) / "
        r".*rate\(flashserve:disagg_handover_bytes_count"
    )
    assert any(re.search(per_prompt, e) for e in exprs)
    # Fallbacks kept apart by reason, as a rate.
    assert re.search(
        r"sum by \([^)]*reason[^)]*\) \(rate\(flashserve:disagg_fallbacks_total", joined
    )
    assert "rate(flashserve:disagg_published_bytes_total" in joined


def test_dashboard_shows_speculative_decoding() -> None:
    """Acceptance rate (accepted over draft tokens) and mean acceptance length
    (1 + accepted over drafts), as rates, and acceptance by draft position."""
    exprs = row_queries("Speculative decoding")
    accepted = r"rate\(flashserve:spec_decode_num_accepted_tokens_total.*\) / "
    assert any(
        re.fullmatch(rf"sum .*{accepted}.*rate\(flashserve:spec_decode_num_draft_tokens_total.*", e)
        for e in exprs
    )
    assert any(
        re.fullmatch(rf"1 \+ sum .*{accepted}.*rate\(flashserve:spec_decode_num_drafts_total.*", e)
        for e in exprs
    )
    assert any(
        re.search(
            r"sum by \([^)]*position[^)]*\) \("
            r"rate\(flashserve:spec_decode_num_accepted_tokens_per_pos_total.*\) "
            r"/ on \(model_name\) group_left .*spec_decode_num_drafts_total",
            e,
        )
        for e in exprs
    )


@pytest.mark.parametrize("role", ROLES)
def test_disaggregated_row_works_on_every_role(role: str) -> None:
    """Every role exposes the row's metrics, a router too, which has no engine metrics."""
    exposed = exposed_names(exercised_scrape(role))
    for expr in row_queries("Disaggregated serving"):
        used = set(METRIC.findall(expr))
        assert used <= exposed, f"{role}: not exposed: {sorted(used - exposed)}"
    if role == "router":
        assert "flashserve:num_requests_running" not in exposed  # as docs/metrics.md says


def test_alerts_cover_queueing_kv_and_errors() -> None:
    rules = {rule["alert"]: rule["expr"] for rule in alert_rules()}
    for alert, metric in {
        "FlashserveHighQueueTime": "request_queue_time_seconds_bucket",
        "FlashserveKVCacheNearFull": "kv_cache_usage_perc",
        "FlashserveSSDWriteErrors": "kv_ssd_write_errors_total",
        "FlashserveSSDChecksumFailuresRising": "kv_ssd_checksum_failures_total",
        "FlashserveNoSuccessfulRequests": "request_success_total",
        "FlashserveDisaggFallbacks": "disagg_fallbacks_total",
    }.items():
        assert f"flashserve:{metric}" in rules[alert], alert


def test_every_alert_has_a_unit_test_where_it_fires() -> None:
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert {rule["alert"] for rule in alert_rules()} <= fired


def test_docs_list_exactly_the_exposed_families(scrape: str) -> None:
    documented = set(
        re.findall(r"`(flashserve:[A-Za-z0-9_:]+)`", (ROOT / "docs/metrics.md").read_text())
    )
    families = set()
    for line in scrape.splitlines():
        if line.startswith("# TYPE ") and not line.split()[2].endswith("_created"):
            families.add(line.split()[2])
    assert families <= documented, sorted(families - documented)
    suffixes = ("_bucket", "_sum", "_count")
    extra = {d for d in documented - families if not d.endswith(suffixes)}
    assert not extra, f"documented but not exposed: {sorted(extra)}"


def test_dashboard_panels_are_well_formed() -> None:
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert '{model_name=~"$model_name"}' in target["expr"], panel["title"]
    # No two panels share a grid cell (24 columns wide).
    cells = set()
    for panel in board["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))
