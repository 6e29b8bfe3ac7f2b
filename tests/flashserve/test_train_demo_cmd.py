"""``flashserve train-demo``'s vision passes: what each argument list asks the stage for,
and the commands docs/QUALITY.md gives reproduce the settings models/demo records."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from flashserve import train_demo_cmd
from training.demo_config import demo_checkpoint_dir

# The commands docs/QUALITY.md gives for the committed tower, after ``--stage vision``.
TOWER_PASS = "--vision-resume 2000 --vision-text-lr 0 --vision-lr 1.5e-3 --vision-minutes 20 "
TOWER_PASS += "--vision-steps 1000"
QUALITY = Path(__file__).parents[2] / "docs" / "QUALITY.md"


def _passes(argv: str) -> list[tuple[dict, str | None]]:
    parser = argparse.ArgumentParser()
    train_demo_cmd.add_arguments(parser)
    args = parser.parse_args(["--stage", "vision", *argv.split()])
    return [(dataclasses.asdict(cfg), key) for cfg, key in train_demo_cmd.vision_passes(args)]


def test_the_default_stage_is_a_first_pass_then_an_annealing_one() -> None:
    (first, first_key), (second, second_key) = _passes("")
    assert first_key is None and second_key is None
    assert (first["probe_steps"], first["steps"], first["lr"], first["text_lr"]) == (
        900,
        600,
        3e-3,
        3e-4,
    )
    assert first["max_seconds"] == 32 * 60 and not first["resume"]
    # Half the rates, no probe, pictures after the first pass's probe and step cap.
    assert (second["lr"], second["text_lr"], second["probe_steps"]) == (1.5e-3, 1.5e-4, 0)
    assert second["resume"] and second["first_picture"] == 900 + 600
    assert second["max_seconds"] == 20 * 60
    assert len(_passes("--vision-anneal-minutes 0")) == 1


def test_a_resumed_pass_with_the_text_frozen_is_recorded_as_the_towers() -> None:
    [(cfg, key)] = _passes(TOWER_PASS)
    assert key == "vision_stage_tower"
    assert cfg["text_lr"] is None and cfg["resume"] and cfg["probe_steps"] == 0
    assert (cfg["first_picture"], cfg["lr"], cfg["steps"]) == (2000, 1.5e-3, 1000)
    [(trained, trained_key)] = _passes("--vision-resume 5")
    assert trained_key is None and trained["text_lr"] == 3e-4


def test_the_documented_commands_give_the_committed_records_settings() -> None:
    assert TOWER_PASS in QUALITY.read_text(encoding="utf-8")
    records = json.loads((demo_checkpoint_dir() / "training.json").read_text(encoding="utf-8"))
    (first, _), _ = _passes("")
    [(tower, _)] = _passes(TOWER_PASS)
    for got, key in ((first, "vision_stage"), (tower, "vision_stage_tower")):
        want = records[key]["config"]
        # Settings added to the stage after a pass ran are absent from its record.
        assert {k: v for k, v in got.items() if k in want} == want, key
