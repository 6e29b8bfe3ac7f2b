"""``flashserve train-demo --stage dspark``: distil the demo's DSpark drafter, target frozen.

On top of an existing demo checkpoint: prompts from the demo's own corpus and chats
rendered as the server renders them (training/dspark_prompts.py), the target's
greedy continuations through the engine (training/dspark_rollouts.py), then
drafting rounds under a wall-clock budget (training/dspark_distill.py). The
checkpoint gets the drafter's ``mtp.*`` tensors under the release's names and
formats (the text tensors byte for byte), the ``dspark_*`` fields in config.json
and the recipe in training.json (``dspark_stage``). Acceptance is measured twice
on held-out-play prompts: on the trained fp32 drafter and on the drafter as the
written checkpoint serves it (FP8 / FP4 weights).

The drafter's shape for the 8-layer demo (``DSparkShape``): a block of 5 (K = 4
drafts plus the slot a K = 5 round would use, the release's size), one stage
(the release's ``num_nextn_predict_layers``), the block inputs of the last three
target layers as context (the release reads its last three too: the late layers
know most about the next tokens), a Markov head of rank 16 (the demo's hidden
size is 256; the release's 256 of 4096) and 4 experts, top-1 (a quarter of the
demo's 8: the drafter must cost little next to the target).
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from engine.loader.checkpoint import load_checkpoint
from engine.loader.checkpoint_writer import encode_tensor, write_config
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.registry import spec_of
from training.corpus import Play, load_corpus
from training.dspark_distill import DistillConfig, Rollout, acceptance, attach_drafter, distill
from training.dspark_prompts import PromptMix, draw_prompts
from training.dspark_rollouts import engine_rollouts
from training.stage_checkpoint import record_stage, replace_tensors

DRAFTER_PREFIX = "mtp."
STAGE = "dspark_stage"  # its record's key in training.json


@dataclass(frozen=True, slots=True)
class DSparkShape:
    """The ``dspark_*`` config fields the stage writes (see the module docstring)."""

    block_size: int = 5
    target_layer_ids: tuple[int, ...] = (5, 6, 7)
    markov_rank: int = 16
    n_routed_experts: int = 4
    num_experts_per_tok: int = 1

    def apply(self, config: ModelConfig) -> ModelConfig:
        return config.replace(
            num_nextn_predict_layers=1,
            dspark_block_size=self.block_size,
            dspark_target_layer_ids=list(self.target_layer_ids),
            dspark_markov_rank=self.markov_rank,
            dspark_n_routed_experts=self.n_routed_experts,
            dspark_num_experts_per_tok=self.num_experts_per_tok,
        )


@dataclass(frozen=True, slots=True)
class DSparkStageConfig:
    """The recipe: prompts (train / held-out), tokens per rollout, the distillation."""

    train_prompts: int = 320
    heldout_prompts: int = 48
    new_tokens: int = 64
    chat_fraction: float = 0.3
    tool_fraction: float = 0.2
    k: int = 4
    seed: int = 0
    # Steps: a cap; the budget (``max_seconds``, from ``--dspark-minutes``) decides.
    distill: DistillConfig = field(
        default_factory=lambda: DistillConfig(steps=100_000, batch=8, lr=2e-3)
    )
    shape: DSparkShape = field(default_factory=DSparkShape)


def drafter_model(demo_dir: Path, shape: DSparkShape) -> tuple[ModelConfig, DeepseekV41]:
    """The demo's text model as served (packed weights) with the drafter's config
    fields set; its own drafter (if the checkpoint has one) is replaced later."""
    _, model = load_checkpoint(demo_dir)
    assert isinstance(model, DeepseekV41)
    config = shape.apply(model.config)
    model.config = config
    return config, model.eval()


def rollouts_for(
    model: DeepseekV41,
    tokenizer: Tokenizer,
    plays: list[Play],
    count: int,
    cfg: DSparkStageConfig,
    seed: int,
) -> tuple[list[Rollout], dict[str, int]]:
    prompts = draw_prompts(
        tokenizer, plays, PromptMix(count, cfg.chat_fraction, cfg.tool_fraction), seed
    )
    made = engine_rollouts(model, prompts, cfg.new_tokens, max_num_seqs=64, tokenizer=tokenizer)
    return made.rollouts, {"prompts": count, "mismatches": made.mismatches, "rows": made.rows}


def drafter_tensors(model: DeepseekV41, config: ModelConfig) -> dict[str, torch.Tensor]:
    """``mtp.*`` as the release stores them (the format table's rules)."""
    assert model.mtp is not None
    rules = spec_of(config).weights
    out: dict[str, torch.Tensor] = {}
    for name, value in model.mtp.state_dict().items():
        out |= encode_tensor(DRAFTER_PREFIX + name, value, rules)
    return out


def write_drafter_checkpoint(
    demo_dir: Path,
    out_dir: Path,
    config: ModelConfig,
    model: DeepseekV41,
    record: dict[str, Any],
) -> None:
    """``out_dir``: ``demo_dir``'s other tensors byte for byte plus the drafter, the
    config with the drafter's fields, ``training.json`` with ``record`` under ``dspark_stage``."""
    replace_tensors(demo_dir, out_dir, (DRAFTER_PREFIX,), drafter_tensors(model, config))
    if demo_dir.resolve() != out_dir.resolve():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out_dir / name).write_bytes((demo_dir / name).read_bytes())
    write_config(out_dir, config)
    record_stage(demo_dir, out_dir, STAGE, record)


def served_acceptance(out_dir: Path, held: list[Rollout], k: int) -> tuple[float, list[float]]:
    """Acceptance of the drafter as ``out_dir`` serves it (packed weights, as loaded)."""
    _, served = load_checkpoint(out_dir)
    assert isinstance(served, DeepseekV41) and served.mtp is not None
    return acceptance(served.eval(), held, k)


def build_dspark_stage(
    demo_dir: Path,
    out_dir: Path,
    cache_dir: Path,
    cfg: DSparkStageConfig,
    *,
    plays: tuple[list[Play], list[Play]] | None = None,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Distil the drafter on ``demo_dir``'s model and write ``out_dir``; returns the record.

    ``plays``: (training, held-out) plays instead of the corpus in ``cache_dir`` (tests).
    """
    started = time.monotonic()
    torch.manual_seed(cfg.seed)
    config, model = drafter_model(demo_dir, cfg.shape)
    tokenizer = Tokenizer.from_file(str(demo_dir / "tokenizer.json"))
    if plays is None:
        corpus = load_corpus(cache_dir)
        plays = (corpus.train, corpus.heldout)
    t0 = time.monotonic()
    train, train_info = rollouts_for(model, tokenizer, plays[0], cfg.train_prompts, cfg, cfg.seed)
    held, held_info = rollouts_for(
        model, tokenizer, plays[1], cfg.heldout_prompts, cfg, cfg.seed + 1
    )
    rollout_s = time.monotonic() - t0
    say(f"dspark rollouts: {len(train)} + {len(held)} in {rollout_s:.0f} s, {train_info}")
    # The warm start copies the last layer's values: read them unpacked.
    _, plain = load_checkpoint(demo_dir, quantization="none")
    assert isinstance(plain, DeepseekV41)
    attach_drafter(model, cfg.seed, warm_from=plain)
    del plain
    before = acceptance(model, held, cfg.k)
    t1 = time.monotonic()
    losses = distill(model, train, cfg.distill, say)
    train_s = time.monotonic() - t1
    trained = acceptance(model, held, cfg.k)
    seen = acceptance(model, train, cfg.k)
    record: dict[str, Any] = {
        "command": "flashserve train-demo --stage dspark",
        "shape": asdict(cfg.shape),
        "config": asdict(cfg),
        "rollouts": {"train": train_info, "heldout": held_info, "seconds": round(rollout_s, 1)},
        "steps": len(losses),
        "train_seconds": round(train_s, 1),
        "loss_first_last": [round(losses[0], 4), round(losses[-1], 4)],
        "loss_every_100": [round(x, 4) for x in losses[::100]],
        "k": cfg.k,
        "heldout_mean_acceptance_length_untrained": round(before[0], 4),
        "heldout_mean_acceptance_length_fp32": round(trained[0], 4),
        "heldout_acceptance_per_position_fp32": [round(x, 4) for x in trained[1]],
        "train_mean_acceptance_length_fp32": round(seen[0], 4),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
    }
    write_drafter_checkpoint(demo_dir, out_dir, config, model, record)
    served = served_acceptance(out_dir, held, cfg.k)
    record["heldout_mean_acceptance_length"] = round(served[0], 4)
    record["heldout_acceptance_per_position"] = [round(x, 4) for x in served[1]]
    record["wall_seconds"] = round(time.monotonic() - started, 1)
    # The served figures are known only after writing: the record is written again.
    record_stage(out_dir, out_dir, STAGE, record)
    say(
        f"dspark stage: acceptance length {served[0]:.3f} at K={cfg.k} on held-out prompts "
        f"(fp32 {trained[0]:.3f}, untrained {before[0]:.3f}); wrote {out_dir}"
    )
    return record
