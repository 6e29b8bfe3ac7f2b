"""The headline of docs/BENCHMARKS.md: its table and plots, from one data file.

    .venv/bin/python bench/plot_headline.py            # PNGs into docs/benchmarks/
    .venv/bin/python bench/plot_headline.py --table    # the markdown table, to stdout

The figures live in ``docs/benchmarks/headline.json`` (one entry per goal: the
latest measured figure, the command that reproduces it, its date); re-measuring a
goal means editing that entry, then running this script and pasting the table.
Plots (matplotlib, the test extra):

- ``goals.png``: every goal with a target, as the measured figure over the
  target, oriented so that 1 or more means met (lower-is-better goals are
  inverted), on a log scale;
- ``restore-vs-recompute.png``: restoring a prefix from the SSD tier plus its
  replay against recomputing it, per prompt length;
- ``kv-bytes.png``: global KV bytes per token of context, FP4 against bf16.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "benchmarks" / "headline.json"
OUT = ROOT / "docs" / "benchmarks"
PLOTS = ("goals.png", "restore-vs-recompute.png", "kv-bytes.png")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def goal_score(goal: dict[str, Any]) -> float:
    """Measured over target, oriented so that >= 1 means the goal is met."""
    measured, target = float(goal["measured"]), float(goal["target"])
    return target / measured if goal["better"] == "lower" else measured / target


def target_text(goal: dict[str, Any]) -> str:
    if "target" not in goal:
        return ""
    sign = "<=" if goal["better"] == "lower" else ">="
    return f"{sign} {goal['target']:g}"


def status_text(goal: dict[str, Any]) -> str:
    if "target" not in goal:
        return ""
    return "met" if goal_score(goal) >= 1.0 else "missed"


def markdown_table(data: dict[str, Any]) -> str:
    lines = [
        "| what you get | latest figure | goal | | reproduce | date |",
        "|---|---|---|---|---|---|",
    ]
    for g in data["goals"]:
        cells = [g["goal"], g["figure"], target_text(g), status_text(g)]
        cells += [f"`{g['command']}`", g["date"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_goals(data: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    goals = [g for g in data["goals"] if "target" in g]
    scores = [goal_score(g) for g in goals]
    fig, ax = plt.subplots(figsize=(11, 0.55 * len(goals) + 1.2))
    colors = ["tab:green" if s >= 1.0 else "tab:orange" for s in scores]
    y = list(range(len(goals)))
    ax.barh(y, scores, color=colors)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xscale("log")
    ticks = [0.1, 0.2, 0.5, 1, 2, 5, 10]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    labels = [textwrap.fill(f"{g['goal']} ({g['figure']})", 60) for g in goals]
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("measured / goal, oriented: >= 1 is met (log scale)")
    ax.set_title("Each goal against its target (CPU, tiny model)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_restore(data: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    r = data["restore"]
    x = range(len(r["prompts"]))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    restore_and_replay = [a + b for a, b in zip(r["restore_s"], r["replay_s"], strict=True)]
    ax.bar([i - 0.2 for i in x], restore_and_replay, width=0.4, label="SSD restore + replay")
    ax.bar([i + 0.2 for i in x], r["recompute_s"], width=0.4, label="recompute (CED prefill)")
    ax.set_yscale("log")
    ax.set_xticks(list(x), r["prompts"])
    ax.set_ylabel("seconds (log scale)")
    ax.set_title("A cached prefix: restore vs recompute")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_kv_bytes(data: dict[str, Any], out: Path) -> None:
    import matplotlib.pyplot as plt

    k = data["kv_bytes"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = ax.bar(k["labels"], k["bytes"], color=["tab:blue", "tab:blue", "tab:gray"])
    ax.bar_label(bars, [f"{b:,g} B" for b in k["bytes"]])
    ax.set_ylabel("bytes per token of context")
    ax.set_title("Global KV per token, official model")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_plots(data: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / name for name in PLOTS]
    for draw, path in zip((plot_goals, plot_restore, plot_kv_bytes), paths, strict=True):
        draw(data, path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the figures (JSON)")
    parser.add_argument("--out", type=Path, default=OUT, help="where the PNGs go")
    parser.add_argument("--table", action="store_true", help="print the markdown table only")
    args = parser.parse_args(argv)
    data = load(args.data)
    if args.table:
        print(markdown_table(data))
        return 0
    for path in write_plots(data, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
