"""The demo's vision stage: a small tower taught to see rendered shapes.

Starting from the committed text checkpoint, the stage adds a ViT, the aligner
and the three span vectors (``DEMO_VISION``: only the tower is small, the image
processor keeps the release's settings) and the image placeholder token
(training/image_token.py), and trains:

1. **probe**: the tower alone, read by linear heads (``SceneHeads``, dropped
   after) that are told what each patch, each cell and the picture show. A step
   costs a fraction of a language-model step, and the tower arrives at stage 2
   already saying what the picture holds.
2. **align**: chats about one picture each (training/vision_chat.py, several
   turns per picture to spread one image's cost over more answers), next-token
   loss on the replies under the exact forward; the text model frozen, or
   trained too (``text_lr``) with a distilled text replay beside every chat.

Every picture comes from a seed (training/vision_data.py); training takes seeds
0, 1, 2, ... and the held-out evaluation seeds from ``HELDOUT_SEED_BASE`` on.
With the text model frozen its tensors are copied byte for byte; trained, they
are written in their stored formats; the drafter (``mtp.*``) always byte for byte.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import nn

from engine.loader.checkpoint import load_checkpoint
from engine.loader.checkpoint_writer import encode_tensor, write_config
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.engram import build_compressed_vocab
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.vision.aligner import merge_cells
from engine.model.deepseek_v41.vision.config import VisionConfig, with_vision
from engine.model.deepseek_v41.vision.image_plan import ImagePlan, fitted_size
from engine.model.deepseek_v41.vision.image_processor import process_image
from engine.model.deepseek_v41.vision.span import SpanRole, span_roles
from engine.model.kv.dense_backend import DenseKV
from engine.model.registry import spec_of
from engine.model.semantics.replay import ReplayPlan
from training.corpus import load_corpus
from training.data import SequenceSampler
from training.image_token import with_image_token
from training.stage_checkpoint import record_stage, replace_tensors
from training.trainer import next_token_loss
from training.vision_chat import image_chat
from training.vision_data import (
    BACKGROUNDS,
    COLOURS,
    SHAPES,
    SIZE,
    Scene,
    outline_normals,
    png_bytes,
    qa_turns,
    render_scene,
    scene_mask,
)
from training.vision_eval import EXACT_KV, HELDOUT_SEED_BASE, score_pictures
from training.weight_qat import quantised_weights

# CPU-sized: 2 blocks of width 128 over the 39 x 39 patches of a 544 x 544 picture
# (attention over 1,521 patches is most of the tower's time).
DEMO_VISION = VisionConfig(
    num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=256
)
VISION_PREFIXES = ("vision.", "aligner.", "image_")
# The drafter (DSpark, ``mtp.*``) never trains here: the DSpark stage distils it
# afterwards from the model this stage writes.
DRAFTER_PREFIX = "mtp."
FROZEN_WITH_TEXT = (*VISION_PREFIXES, DRAFTER_PREFIX)
REPLAY_EOS_WEIGHT = 3.0  # the demo's second text stage's
BACKGROUNDS_INDEX = {name: i for i, name in enumerate(BACKGROUNDS)}


@dataclass(frozen=True, slots=True)
class VisionTrainConfig:
    probe_steps: int = 900
    probe_lr: float = 3e-3
    # The probe's outline head (``SceneHeads``): off in the committed recipe, whose
    # pictures are turned at random; 4 in the upright trial of docs/QUALITY.md.
    outline_weight: float = 0.0
    row_shape: bool = False  # every row told the picture's shape too
    # False: no per-cell or per-row targets, only the outline and the rows' mean
    # (the upright trial of docs/QUALITY.md that read shape).
    cell_targets: bool = True
    probe_weight: float = 0.5  # the probe's loss beside the chats' in stage 2
    steps: int = 600  # at most; a wall-clock budget (``max_seconds``) may stop it first
    max_seconds: float | None = 32 * 60.0
    lr: float = 3e-3
    # None: the text model stays frozen. A rate: it trains too, at that peak rate,
    # under quantisation-aware training (what is trained is what the checkpoint
    # serves), with a text replay sequence beside each picture's chat so that it
    # keeps its text (its numbers must then be measured again).
    text_lr: float | None = None
    replay_len: int = 128  # tokens of the replay sequence (0: no replay)
    replay_weight: float = 1.0
    # Chats among the replay sequences: a picture chat's one-line answer teaches the
    # model to answer every user turn that way unless text chats say otherwise.
    replay_chat_fraction: float = 0.4
    # Replay by distillation: a replay sequence's targets are the starting text
    # model's next-token distributions (KL), not its next tokens, so text-only input
    # keeps the starting model's answers rather than drifting with every step.
    distil_replay: bool = True
    # Replay sequences that are a picture chat's questions and answers with no
    # picture (the starting model's distributions their targets): the answer's form
    # is tied to the span, not to the question.
    negative_fraction: float = 0.3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    turns: int = 3  # question-answer turns per picture
    thinking_fraction: float = 0.1  # chats in the thinking request's layout
    image_last_fraction: float = 0.25  # pictures after the first question
    eval_every: int = 250  # a held-out check of 12 pictures costs about half a minute
    eval_images: int = 12
    seed: int = 0
    # Go on from the tower ``demo_dir`` already carries (a second run of the stage)
    # instead of a fresh one; the pictures go on from where ``first_picture`` says.
    resume: bool = False
    first_picture: int = 0


def seeing_model(
    demo_dir: Path, vision: VisionConfig, seed: int, keep_tower: bool = False
) -> tuple[ModelConfig, DeepseekV41, Tokenizer, dict[str, Any]]:
    """The demo text model with an untrained tower and the placeholder in its tokenizer.

    Returns the config, the model (text frozen, tower trainable), the tokenizer and
    its ``tokenizer.json`` dict.
    """
    text_config, text = load_checkpoint(demo_dir, quantization="none", engram_mmap=False)
    data, image_id = with_image_token(
        json.loads((demo_dir / "tokenizer.json").read_text(encoding="utf-8"))
    )
    tokenizer = Tokenizer.from_str(json.dumps(data))
    config = with_vision(text_config, vision, token_id=image_id)
    model = DeepseekV41(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    if text.dspark is None:  # the text checkpoint carries no drafter: neither does this one
        model.drop_drafter()
    # A checkpoint that already sees (a rerun) starts from a fresh tower too, unless
    # ``keep_tower`` (a run that goes on from it).
    state = {
        n: t
        for n, t in text.state_dict().items()
        if keep_tower or not n.startswith(VISION_PREFIXES)
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(n.startswith(VISION_PREFIXES) for n in missing), missing
    if keep_tower and missing:
        raise ValueError(f"{demo_dir} has no tower to go on from (missing {missing[0]})")
    model.set_compressed_vocab(build_compressed_vocab(tokenizer)[0])
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(VISION_PREFIXES))
    return config, model, tokenizer, data


def _lr(
    step: int, steps: int, cfg: VisionTrainConfig, peak: float, progress: float | None = None
) -> float:
    """Linear warmup, then cosine to ``min_lr_ratio``; over the budget's elapsed share
    ``progress`` when training has a wall-clock budget (as the text stages' trainer)."""
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(steps - cfg.warmup_steps, 1)
    if progress is not None:
        t = min(progress, 1.0)
    return peak * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _step(
    opt: torch.optim.Optimizer,
    params: list[nn.Parameter],
    lr: float,
    clip: float,
    peak: float | None = None,
) -> None:
    """One update at ``lr`` of a schedule peaking at ``peak``; a group with its own
    ``peak`` follows the same schedule scaled to it."""
    for group in opt.param_groups:
        own = group.get("peak")
        group["lr"] = lr if own is None or peak is None else lr * own / peak
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    opt.zero_grad(set_to_none=True)


# A cell (one aligner row: downsample_ratio^2 patches) is on the shape's edge when
# between these shares of its pixels are the shape's, inside above, background below.
EDGE_SHARE = (0.08, 0.92)
BACKGROUND, INSIDE, EDGE = range(3)


def cell_regions(scene: Scene, vision: VisionConfig) -> torch.Tensor:
    """[cells] int64: each aligner row's place in ``scene`` (``BACKGROUND``, ``INSIDE`` or
    ``EDGE``), from the share of its pixels the shape covers: the shape's mask goes
    through the image processor and the aligner's cell merge as the picture does."""
    mask = process_image(png_bytes(scene_mask(scene)), vision)
    plan = mask.plan
    # Normalised pixels are 2 x share - 1; a padded pixel (gray 127) counts as half.
    share = ((mask.patches.float().mean(-1, keepdim=True) + 1) / 2).clamp(0, 1)
    cells = merge_cells(share, plan.n_vit_h, plan.n_vit_w, vision.downsample_ratio).mean(-1)
    low, high = EDGE_SHARE
    regions = torch.full(cells.shape, EDGE, dtype=torch.long)
    regions[cells <= low] = BACKGROUND
    regions[cells >= high] = INSIDE
    return regions


# Harmonics of the outline's normal angle a patch on it is told: even ones (a normal
# and its opposite are one line), and 2, 4, 6, 10 because the upright shapes' mean
# outlines differ there (a square's sides give cos 4a = 1, a triangle's cos 6a = -1,
# a star's cos 10a = -1, a circle's all of them 0).
OUTLINE_HARMONICS = (2, 4, 6, 10)


def patch_outlines(scene: Scene, plan: ImagePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the ViT's patches the shape's outline crosses ([n_patches] bool: the
    outline within half a patch of its centre) and what its normal's harmonics are
    there ([n_patches, 2 x len(OUTLINE_HARMONICS)]: cos and sin of each)."""
    # Where the processor puts the picture in its box (fitted, centred).
    fitted, _ = fitted_size(SIZE, SIZE, plan.box_width, plan.box_height)
    scale = fitted / SIZE
    offset_x = round((plan.box_width - fitted) * 0.5)
    offset_y = round((plan.box_height - fitted) * 0.5)
    ys, xs = torch.meshgrid(
        (torch.arange(plan.n_vit_h) + 0.5) * plan.patch_size - offset_y,
        (torch.arange(plan.n_vit_w) + 0.5) * plan.patch_size - offset_x,
        indexing="ij",
    )
    points = torch.stack([xs.flatten(), ys.flatten()], -1) / scale
    distance, angle = outline_normals(scene, points)
    on = distance < plan.patch_size / scale / 2
    harmonics = [f(k * angle) for k in OUTLINE_HARMONICS for f in (torch.cos, torch.sin)]
    return on, torch.stack(harmonics, -1)


@dataclass(frozen=True, slots=True)
class SceneTargets:
    """What the probe tells the tower about one picture, beside its labels."""

    regions: torch.Tensor  # [cells] BACKGROUND / INSIDE / EDGE (``cell_regions``)
    outline: torch.Tensor  # [n_patches] bool: patches the outline crosses
    harmonics: torch.Tensor  # [n_patches, 8]: the outline's normal there (``patch_outlines``)


def scene_targets(scene: Scene, plan: ImagePlan, vision: VisionConfig) -> SceneTargets:
    return SceneTargets(cell_regions(scene, vision), *patch_outlines(scene, plan))


class SceneHeads(nn.Module):
    """Linear heads from the tower's outputs to what the picture shows (dropped after
    training).

    Each aligner row is told what its own cell shows (dense targets, from the
    shape's mask): background, inside the shape or on its edge; the shape, on an
    edge cell; the colour, on a cell the shape covers; the background's shade, on a
    background cell. Every row is also told the picture's colour (and its shape with
    ``row_shape``), so the language model can read it from any row, within its
    sliding window of the question too; the rows' mean is told both, as the language
    model's attention pools them. With ``outline_weight``, each ViT patch the
    shape's outline crosses is also told the outline's direction there
    (``patch_outlines``, squared error): a local question whose answers, averaged
    over an upright picture, tell the shapes apart. Told only the picture's labels,
    a 2-block tower reads colour within a thousand pictures but stays at chance on
    shape (docs/QUALITY.md)."""

    def __init__(
        self,
        width: int,
        vit_width: int,
        outline_weight: float = 0.0,
        row_shape: bool = False,
        cell_targets: bool = True,
    ) -> None:
        super().__init__()
        self.outline = nn.Linear(vit_width, 2 * len(OUTLINE_HARMONICS))
        self.outline_weight = outline_weight
        self.row_shape = row_shape
        self.cell_targets = cell_targets
        self.region = nn.Linear(width, 3)
        self.shape = nn.Linear(width, len(SHAPES))
        self.colour = nn.Linear(width, len(COLOURS))
        self.background = nn.Linear(width, len(BACKGROUNDS))
        self.picture_shape = nn.Linear(width, len(SHAPES))
        self.picture_colour = nn.Linear(width, len(COLOURS))

    def loss(
        self, features: torch.Tensor, cells: torch.Tensor, scene: Scene, targets: SceneTargets
    ) -> torch.Tensor:
        """The outline's squared error (weighted) plus the summed cross-entropy of the
        per-cell and per-picture guesses (each a mean over its rows)."""

        def ce(head: nn.Linear, rows: torch.Tensor, truth: int) -> torch.Tensor:
            if not len(rows):
                return rows.new_zeros(())
            return F.cross_entropy(head(rows), torch.full((len(rows),), truth))

        shape, colour = SHAPES.index(scene.shape), list(COLOURS).index(scene.colour)
        regions = targets.regions
        pooled = cells.mean(0, keepdim=True)
        total = features.new_zeros(())
        if self.outline_weight and targets.outline.any():
            on = targets.outline
            outline = F.mse_loss(self.outline(features[on]), targets.harmonics[on])
            total = total + self.outline_weight * outline
        if self.row_shape:
            total = total + ce(self.picture_shape, cells, shape)
        total = (
            total + ce(self.picture_shape, pooled, shape) + ce(self.picture_colour, pooled, colour)
        )
        if not self.cell_targets:
            return total
        return (
            total
            + F.cross_entropy(self.region(cells), regions)
            + ce(self.shape, cells[regions == EDGE], shape)
            + ce(self.colour, cells[regions != BACKGROUND], colour)
            + ce(self.background, cells[regions == BACKGROUND], BACKGROUNDS_INDEX[scene.background])
            + ce(self.picture_colour, cells, colour)
        )


@contextlib.contextmanager
def tower_output(vit: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The ViT's outputs while inside (the patches' features ``encode_image`` feeds the
    aligner), for the probe's outline head beside the chats, without a second ViT pass."""
    seen: list[torch.Tensor] = []
    handle = vit.register_forward_hook(lambda _m, _i, out: seen.append(out))
    try:
        yield seen
    finally:
        handle.remove()


def cell_rows(rows: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
    """The aligner rows among a span's ``rows`` (no start, newline or end)."""
    return rows[span_roles(plan.n_llm_h, plan.n_llm_w) == SpanRole.CELL]


def tower_cells(
    model: DeepseekV41, seed: int
) -> tuple[Scene, ImagePlan, torch.Tensor, torch.Tensor]:
    """Picture ``seed`` through the ViT and the aligner alone: its scene, its plan, the
    patches' features and the cells' rows (what the probe's heads read)."""
    assert model.vision is not None and model.aligner is not None
    image, scene = render_scene(seed)
    processed = process_image(png_bytes(image), model.vision.vision)
    plan = processed.plan
    features = model.vision(processed.patches, plan.n_vit_h, plan.n_vit_w)
    return scene, plan, features, model.aligner(features, plan.n_vit_h, plan.n_vit_w)


def train_probe(
    model: DeepseekV41, heads: SceneHeads, cfg: VisionTrainConfig, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """Stage 1: the tower alone, taught by ``heads`` (``SceneHeads``) what each patch,
    each cell and the picture show, before any chat; the heads' held-out accuracy on
    the rows' mean is logged every ``cfg.eval_every`` steps."""
    assert model.vision is not None and model.aligner is not None
    params = [*model.vision.parameters(), *model.aligner.parameters(), *heads.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.probe_lr, weight_decay=cfg.weight_decay)
    log: list[dict[str, Any]] = []
    running = 0.0
    for step in range(cfg.probe_steps):
        scene, plan, features, cells = tower_cells(model, step)
        targets = scene_targets(scene, plan, model.vision.vision)
        loss = heads.loss(features, cells, scene, targets)
        loss.backward()
        loss = loss.detach()
        _step(opt, params, _lr(step, cfg.probe_steps, cfg, cfg.probe_lr), cfg.grad_clip)
        running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
        entry: dict[str, Any] = {"step": step, "loss": round(running, 4)}
        if (step + 1) % cfg.eval_every == 0 or step == cfg.probe_steps - 1:
            seeds = range(HELDOUT_SEED_BASE, HELDOUT_SEED_BASE + cfg.eval_images)
            entry["heldout"] = probe_accuracy(model, heads, seeds)
        if step % 50 == 0 or "heldout" in entry:
            log.append(entry)
            say(f"probe {step}: loss {running:.3f} {entry.get('heldout', '')}")
    return log


@torch.no_grad()
def probe_accuracy(model: DeepseekV41, heads: SceneHeads, seeds: range) -> dict[str, float]:
    """How often the heads on the rows' mean name held-out pictures' shape and colour:
    what the tower says before any language model reads it."""
    right = {"shape": 0, "colour": 0}
    for seed in seeds:
        scene, _, _, cells = tower_cells(model, seed)
        pooled = cells.mean(0)
        right["shape"] += int(heads.picture_shape(pooled).argmax()) == SHAPES.index(scene.shape)
        colour = int(heads.picture_colour(pooled).argmax())
        right["colour"] += colour == list(COLOURS).index(scene.colour)
    return {f"{k}_accuracy": round(v / max(len(seeds), 1), 4) for k, v in right.items()}


def chat_loss(
    model: DeepseekV41, ids: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """Mean cross-entropy of the ids under ``targets``, each predicted from the row
    before it (EOS weighted as the text stages weight it)."""
    kv = DenseKV(model.config, ids, ReplayPlan.exact(model.config), None, EXACT_KV, torch.float32)
    logits = model(ids, kv, image_embeds=rows)
    keep = targets[1:]
    return next_token_loss(logits[:-1][keep], ids[1:][keep], REPLAY_EOS_WEIGHT)


def distil_loss(model: DeepseekV41, teacher: DeepseekV41, ids: torch.Tensor) -> torch.Tensor:
    """KL(teacher || model) of the next-token distributions, summed over the vocabulary
    and averaged over the positions of a text-only sequence ``ids``."""
    plan = ReplayPlan.exact(model.config)
    with torch.no_grad():
        kv = DenseKV(teacher.config, ids, plan, None, EXACT_KV, torch.float32)
        target = teacher(ids, kv).float().log_softmax(-1)
    kv = DenseKV(model.config, ids, plan, None, EXACT_KV, torch.float32)
    logp = model(ids, kv).float().log_softmax(-1)
    return F.kl_div(logp, target, reduction="batchmean", log_target=True)


def replay_sampler(
    tokenizer: Tokenizer, cfg: VisionTrainConfig, cache_dir: Path
) -> SequenceSampler:
    """Text sequences of the demo's second text stage's kinds (json_warm_start's
    ``SHIPPED_STAGE_2``: chats, 10% tool calls, served ends, short replies), with
    ``cfg.replay_chat_fraction`` chats."""
    corpus = load_corpus(cache_dir)
    return SequenceSampler(
        tokenizer,
        corpus.train,
        cfg.replay_len,
        cfg.replay_chat_fraction,
        cfg.seed,
        0.1,
        served_ends=True,
        short_replies=0.5,
    )


def train_align(
    model: DeepseekV41,
    tokenizer: Tokenizer,
    cfg: VisionTrainConfig,
    say: Callable[[str], None],
    replay: SequenceSampler | None = None,
    heads: SceneHeads | None = None,
    teacher: DeepseekV41 | None = None,
) -> list[dict[str, Any]]:
    """Stage 2: chats about pictures, through the language model (frozen unless
    ``cfg.text_lr``; then each step also takes a ``replay`` text sequence, or a
    picture chat's turns with no picture (``cfg.negative_fraction``), distilled
    from ``teacher``, the starting model, when given). The probe's ``heads`` keep
    training beside it (``cfg.probe_weight``), so the rows keep saying what the
    picture shows while the language model learns to read them."""
    assert model.vision is not None and model.image_token_id is not None
    vision = model.vision.vision
    tower = [p for n, p in model.named_parameters() if n.startswith(VISION_PREFIXES)]
    if heads is not None:
        tower += list(heads.parameters())
    groups: list[dict[str, Any]] = [{"params": tower, "peak": cfg.lr}]
    params = list(tower)
    trains_text = cfg.text_lr is not None
    if trains_text:
        text = [p for n, p in model.named_parameters() if not n.startswith(FROZEN_WITH_TEXT)]
        for p in text:
            p.requires_grad_(True)
        groups.append({"params": text, "peak": cfg.text_lr})
        params += text
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    log: list[dict[str, Any]] = []
    running = 0.0
    began = time.monotonic()
    for step in range(cfg.steps):
        progress = None
        if cfg.max_seconds is not None:
            progress = (time.monotonic() - began) / cfg.max_seconds
        last = step == cfg.steps - 1 or (progress is not None and progress >= 1.0)
        model.train()
        seed = cfg.probe_steps + cfg.first_picture + step  # pictures the probe did not see
        image, scene = render_scene(seed)
        processed = process_image(png_bytes(image), vision)
        chat = image_chat(
            tokenizer,
            model.image_token_id,
            processed.tokens,
            qa_turns(seed, scene, cfg.turns),
            thinking=rng.random() < cfg.thinking_fraction,
            image_last=rng.random() < cfg.image_last_fraction,
        )
        # The text model's served (FP8 / MXFP4) values in the forward when it trains.
        with quantised_weights(model) if trains_text else contextlib.nullcontext():
            with tower_output(model.vision) as seen:
                rows = model.encode_image(processed.patches, processed.plan)
            loss = chat_loss(model, chat.ids, chat.targets, rows)
            if heads is not None and cfg.probe_weight:
                cells = cell_rows(rows, processed.plan).float()
                targets = scene_targets(scene, processed.plan, vision)
                probe = heads.loss(seen[0], cells, scene, targets)
                (loss + cfg.probe_weight * probe).backward()
            else:
                loss.backward()
            text_loss = None
            if replay is not None and cfg.replay_len:
                if teacher is not None and rng.random() < cfg.negative_fraction:
                    turns = qa_turns(seed, scene, cfg.turns)
                    ids = image_chat(tokenizer, model.image_token_id, 0, turns).ids
                else:
                    ids = replay.sample()
                if teacher is not None:
                    text_loss = distil_loss(model, teacher, ids)
                else:
                    every = torch.ones_like(ids, dtype=torch.bool)
                    text_loss = chat_loss(model, ids, every, None)
                (cfg.replay_weight * text_loss).backward()
        loss = loss.detach()
        _step(opt, params, _lr(step, cfg.steps, cfg, cfg.lr, progress), cfg.grad_clip, cfg.lr)
        running = 0.95 * running + 0.05 * loss.item() if step else loss.item()
        entry: dict[str, Any] = {"step": step, "loss": round(running, 4)}
        if text_loss is not None:
            entry["replay_loss"] = round(text_loss.item(), 4)
        if (step + 1) % cfg.eval_every == 0 or last:
            seeds = range(HELDOUT_SEED_BASE, HELDOUT_SEED_BASE + cfg.eval_images)
            with quantised_weights(model) if trains_text else contextlib.nullcontext():
                score = score_pictures(model, tokenizer, vision, model.image_token_id, seeds)
            entry["heldout"] = score.to_dict()
            say(f"align {step}: loss {running:.3f} held-out {score.to_dict()}")
        if step % 50 == 0 or "heldout" in entry:
            log.append(entry)
            if "heldout" not in entry:
                say(f"align {step}: loss {running:.3f} replay {entry.get('replay_loss')}")
        if last:
            break
    return log


def annealing_pass(cfg: VisionTrainConfig, minutes: float) -> VisionTrainConfig:
    """The second pass that goes on from the first's tower and text: no probe, half the
    first pass's peak rates, on the pictures after the first pass's step cap (none of
    which either pass has seen). The first pass stops at its step cap with the rates
    still high; this one anneals them (on the committed demo it lifted held-out colour
    from 72% to 89%: docs/QUALITY.md)."""
    return dataclasses.replace(
        cfg,
        resume=True,
        probe_steps=0,
        probe_weight=0.0,
        first_picture=cfg.probe_steps + cfg.steps,
        lr=cfg.lr / 2,
        text_lr=None if cfg.text_lr is None else cfg.text_lr / 2,
        max_seconds=minutes * 60,
    )


def trained_tensors(
    model: DeepseekV41, config: ModelConfig, text_too: bool
) -> dict[str, torch.Tensor]:
    """What the stage trained, as stored (the name rules: BF16 tower with FP32 norms
    and span vectors; FP8 / MXFP4 text weights): the tower, and the text model when
    ``text_too`` (never the drafter)."""
    rules = spec_of(config).weights
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name.startswith(VISION_PREFIXES) or (text_too and not name.startswith(DRAFTER_PREFIX)):
            out |= encode_tensor(name, value, rules)
    return out


def write_seeing_checkpoint(
    demo_dir: Path,
    out_dir: Path,
    config: ModelConfig,
    model: DeepseekV41,
    tokenizer_data: dict[str, Any],
    record: dict[str, Any],
    text_too: bool = False,
    stage: str = "vision_stage",
) -> None:
    """``out_dir``: the tower, plus ``demo_dir``'s text tensors byte for byte (the
    trained ones when ``text_too``) and its drafter; the config with
    ``vision_config``; the tokenizer with the placeholder; ``training.json`` with
    ``record`` under ``stage``."""
    tensors = trained_tensors(model, config, text_too)
    # Every name written anew replaces its old self (its scale rides along: an
    # encoded weight's scale is in ``tensors`` too).
    replace_tensors(demo_dir, out_dir, (*VISION_PREFIXES, *(tensors if text_too else ())), tensors)
    if demo_dir.resolve() != out_dir.resolve():
        shutil.copy(demo_dir / "tokenizer_config.json", out_dir / "tokenizer_config.json")
    write_config(out_dir, config)
    Tokenizer.from_str(json.dumps(tokenizer_data)).save(str(out_dir / "tokenizer.json"))
    record_stage(demo_dir, out_dir, stage, record)


def build_vision_stage(
    demo_dir: Path,
    out_dir: Path,
    cfg: VisionTrainConfig,
    *,
    vision: VisionConfig = DEMO_VISION,
    say: Callable[[str], None] = print,
    corpus_dir: Path = Path(".cache/corpus"),
    stage: str | None = None,
) -> Path:
    """Train the tower on top of ``demo_dir``'s text model and write ``out_dir``, its
    record under ``stage`` in training.json (by default ``vision_stage``, or
    ``vision_stage_resumed`` for a pass that goes on from a tower)."""
    started = time.monotonic()
    torch.manual_seed(cfg.seed)
    config, model, tokenizer, data = seeing_model(demo_dir, vision, cfg.seed, cfg.resume)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(f"tower: {trainable / 1e6:.2f} M trainable parameters, image id {model.image_token_id}")
    heads = SceneHeads(
        config.hidden_size, vision.hidden_size, cfg.outline_weight, cfg.row_shape, cfg.cell_targets
    )
    # The starting text model, as served (its dequantised stored values), for the
    # replay's targets.
    teacher = None
    if cfg.text_lr is not None and cfg.distil_replay:
        teacher = copy.deepcopy(model).requires_grad_(False).eval()
    probe_log = train_probe(model, heads, cfg, say)
    replay = None
    if cfg.text_lr is not None and cfg.replay_len:
        replay = replay_sampler(tokenizer, cfg, corpus_dir)
    align_log = train_align(model, tokenizer, cfg, say, replay, heads, teacher)
    record = {
        "command": "flashserve train-demo --stage vision",
        "vision_config": vision.to_dict(),
        "image_token_id": model.image_token_id,
        "trainable_parameters": trainable,
        "config": asdict(cfg),
        "wall_seconds": round(time.monotonic() - started, 1),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "probe_log": probe_log,
        "align_log": align_log,
    }
    # A pass that goes on from a tower keeps the earlier passes' records beside its own.
    stage = stage or ("vision_stage_resumed" if cfg.resume else "vision_stage")
    write_seeing_checkpoint(
        demo_dir, out_dir, config, model, data, record, cfg.text_lr is not None, stage
    )
    say(f"wrote {out_dir} in {record['wall_seconds']:.0f} s")
    return out_dir
