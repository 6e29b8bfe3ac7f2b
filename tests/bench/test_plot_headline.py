"""bench/plot_headline.py: the plots are drawn; BENCHMARKS.md shows the data file's table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from bench import plot_headline

ROOT = Path(__file__).resolve().parents[2]


def test_help_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "plot_headline.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "--table" in result.stdout


def test_every_plot_is_written_as_a_png(tmp_path: Path) -> None:
    assert plot_headline.main(["--out", str(tmp_path)]) == 0
    for name in plot_headline.PLOTS:
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name


def test_the_committed_plots_exist() -> None:
    for name in plot_headline.PLOTS:
        assert (ROOT / "docs" / "benchmarks" / name).stat().st_size > 5000, name


def test_benchmarks_md_shows_the_data_files_table() -> None:
    """A figure edited in headline.json and not in BENCHMARKS.md (or the reverse) fails."""
    table = plot_headline.markdown_table(plot_headline.load(plot_headline.DATA))
    assert table in (ROOT / "docs" / "BENCHMARKS.md").read_text()


def test_status_follows_the_direction_of_each_goal() -> None:
    lower = {"goal": "x", "measured": 0.4, "target": 0.55, "better": "lower"}
    higher = {"goal": "y", "measured": 9.2, "target": 10.0, "better": "higher"}
    assert plot_headline.status_text(lower) == "met"
    assert plot_headline.status_text(higher) == "missed"
    assert plot_headline.target_text(lower) == "<= 0.55"
    assert plot_headline.status_text({"goal": "z"}) == ""


def test_every_reproducing_command_names_a_real_script() -> None:
    for goal in plot_headline.load(plot_headline.DATA)["goals"]:
        command = goal["command"]
        script = re.search(r"(bench/[\w/]+\.py)", command)
        if script:
            assert (ROOT / script.group(1)).exists(), command
        else:
            assert command.startswith((".venv/bin/flashserve ", "make ")), command
