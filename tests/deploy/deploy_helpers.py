"""Shared pieces of the packaging tests: paths, the metrics scrape, PromQL names."""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from pathlib import Path

import yaml

from engine.core.llm_engine import EngineCounters, EngineStats
from kvstore.stats import KVStats, SSDStats
from server.metrics.disagg_metrics import FALLBACK_REASONS, Role
from server.metrics.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/flashserve.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yaml"
ALERTS_TEST = ROOT / "deploy/prometheus/alerts_test.yaml"

# How to render a kustomization: kubectl's built-in kustomize, else kustomize itself;
# None when neither is installed (scripts/install_tools.sh installs kubectl).
if shutil.which("kubectl"):
    RENDER: list[str] | None = ["kubectl", "kustomize"]
elif shutil.which("kustomize"):
    RENDER = ["kustomize", "build"]
else:
    RENDER = None

# A flashserve metric identifier in PromQL (digits too: "e2e_request_latency").
METRIC = re.compile(r"flashserve:[A-Za-z0-9_:]+")


def exercised_scrape(role: Role = "both") -> str:
    """Text exposition of a ``ServerMetrics`` whose every metric has been set once.

    Every role exposes the split-deployment families; a router has no engine
    metrics (its ``set_engine_stats`` feeds nothing).
    """
    m = ServerMetrics("deepseek-flash", role=role)
    m.observe_request(arrival=0.0, first_scheduled=0.2, token_times=[0.9, 0.95, 1.0], finished=1.1)
    kv = KVStats(
        page_tokens=64,
        device_pages_total=100,
        device_pages_in_use=40,
        lookup_tokens=640,
        device_hit_tokens=128,
        ssd_lookup_pages=4,
        ssd_hit_tokens=64,
        ssd=SSDStats(enabled=True, bytes=1 << 20, budget_bytes=1 << 22, checksum_failures=1),
    )
    counters = EngineCounters(
        prompt_tokens=640,
        generation_tokens=32,
        prompt_cache_hit_tokens=192,
        replay_tokens=64,
        finished={"stop": 1, "length": 1, "abort": 1},
        spec_drafts=2,
        spec_draft_tokens=8,
        spec_accepted_tokens=5,
        spec_accepted_per_pos=[2, 2, 1, 0],
    )
    m.set_engine_stats(EngineStats(running=1, waiting=1, preemptions=1, kv=kv, counters=counters))
    disagg = m.disagg
    disagg.prefill_seconds.observe(0.4)
    for reason in FALLBACK_REASONS:
        disagg.fallback(reason)
    disagg.published_pages.inc(4)
    disagg.published_bytes.inc(4 * 34_816)
    disagg.handover_seconds.observe(0.02)
    disagg.handover_bytes.observe(4 * 34_816)
    return m.render().decode()


def scrape_text() -> str:
    """/metrics of a live server when FLASHSERVE_METRICS_URL is set, else ``exercised_scrape``."""
    url = os.environ.get("FLASHSERVE_METRICS_URL")
    if not url:
        return exercised_scrape()
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every dashboard target and template variable query."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['id']} {target['refId']}", target["expr"]))
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            out.append((f"variable {var['name']}", var["definition"]))
    return out


def alert_rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]


def alert_test_series() -> list[str]:
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    return [s["series"] for t in tests for s in t["input_series"]]
