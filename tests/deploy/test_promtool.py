"""promtool on what Prometheus will read: the /metrics scrape and the dashboard's PromQL.

promtool comes from Debian's prometheus package (``make setup``); without it
these tests skip, and ``make lint`` (which needs it) fails first.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_helpers import dashboard_queries

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (make setup installs Debian's prometheus)"
)

# Prometheus reserves ':' for recording rules; flashserve keeps vLLM's "prefix:" style
# (docs/metrics.md), so this is the one finding promtool may report.
COLON = "metric names should not contain ':'"


def check_metrics(text: str) -> list[str]:
    """promtool's lint findings for a scrape (``name finding`` lines)."""
    run = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    findings = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    # 0: clean, 3: lint findings; anything else is promtool failing to read the text.
    assert run.returncode in (0, 3), findings
    assert (run.returncode == 3) == bool(findings)
    return findings


@needs_promtool
def test_scrape_passes_promtool_check_metrics(scrape: str) -> None:
    findings = check_metrics(scrape)
    other = [f for f in findings if not f.endswith(COLON)]
    assert not other, other


@needs_promtool
def test_check_metrics_still_reports_other_problems() -> None:
    """The filter above must not hide real findings: a counter without _total is one."""
    bad = "# HELP flashserve_requests Requests.\n# TYPE flashserve_requests counter\n"
    bad += "flashserve_requests 1\n"
    findings = check_metrics(bad)
    assert findings and not any(f.endswith(COLON) for f in findings)


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Each query, with Grafana's variables filled in, as a recording rule for promtool."""
    rules = [
        {"record": f"dashboard:query_{i}", "expr": _fill(expr)}
        for i, (_, expr) in enumerate(dashboard_queries())
        if not expr.startswith("label_values(")  # Grafana's function, not PromQL
    ]
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(rules)} rules found" in run.stdout


@needs_promtool
def test_promql_check_catches_a_broken_query(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    bad = "sum by (tier (rate(flashserve:prefix_cache_hits_total[5m]))"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "a:b", "expr": bad}]}]})
    )
    run = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, timeout=60)
    assert run.returncode != 0


def _fill(expr: str) -> str:
    return expr.replace("$__rate_interval", "5m").replace("$model_name", ".*")
