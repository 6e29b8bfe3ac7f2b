"""The demo's vision stage: a small tower taught to see rendered shapes, text model frozen.

Starting from the committed text checkpoint, the stage adds a ViT, the aligner
and the three span vectors (``DEMO_VISION``: only the tower is small, the image
processor keeps the release's settings) and the image placeholder token
(training/image_token.py), and trains only those:

1. **probe**: the ViT alone, its mean-pooled features classified into shape,
   colour and background by three linear heads (dropped after). A step costs a
   fifth of a language-model step, and the tower arrives at stage 2 already
   separating the classes, so stage 2 only has to teach the aligner to say them.
2. **align**: chats about one picture each (training/vision_chat.py, several
   turns per picture to spread one image's cost over more answers), next-token
   loss on the replies, through the frozen 8-layer model under the exact forward.

Every picture comes from a seed (training/vision_data.py); training takes seeds
0, 1, 2, ... and the held-out evaluation seeds from ``HELDOUT_SEED_BASE`` on.
The text tensors are copied into the new checkpoint byte for byte, so the text
model's numbers are unchanged by construction.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import time
from collections.abc import Callable
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
from engine.model.deepseek_v41.vision.config import VisionConfig, with_vision
from engine.model.deepseek_v41.vision.image_plan import ImagePlan
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
    Scene,
    png_bytes,
    qa_turns,
    render_scene,
)
from training.vision_eval import EXACT_KV, HELDOUT_SEED_BASE, score_pictures
from training.weight_qat import quantised_weights

# CPU-sized: 2 blocks of width 64 over the 39 x 39 patches of a 544 x 544 picture
# (attention over 1,521 patches is most of the tower's time).
DEMO_VISION = VisionConfig(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128
)
VISION_PREFIXES = ("vision.", "aligner.", "image_")
# The drafter (DSpark, ``mtp.*``) never trains here: the DSpark stage distils it
# afterwards from the model this stage writes.
DRAFTER_PREFIX = "mtp."
FROZEN_WITH_TEXT = (*VISION_PREFIXES, DRAFTER_PREFIX)
REPLAY_EOS_WEIGHT = 3.0  # the demo's second text stage's


@dataclass(frozen=True, slots=True)
class VisionTrainConfig:
    probe_steps: int = 1500
    probe_lr: float = 3e-3
    probe_weight: float = 0.5  # the probe's loss beside the chats' in stage 2
    steps: int = 600  # at most; a wall-clock budget (``max_seconds``) may stop it first
    max_seconds: float | None = 18 * 60.0
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


class SceneHeads(nn.Module):
    """Linear heads from one aligner row to the scene's shape, colour and background."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = nn.ModuleList(
            nn.Linear(width, n) for n in (len(SHAPES), len(COLOURS), len(BACKGROUNDS))
        )

    def loss(self, cells: torch.Tensor, scene: Scene) -> torch.Tensor:
        """Summed cross-entropy of every row's three guesses (mean over the rows) and of
        the rows' mean's: a shape is the arrangement of many rows, which a mean over
        them can carry where one row cannot (as the language model's attention pools)."""
        truths = (
            SHAPES.index(scene.shape),
            list(COLOURS).index(scene.colour),
            list(BACKGROUNDS).index(scene.background),
        )
        total = cells.new_zeros(())
        pooled = cells.mean(0, keepdim=True)
        for head, truth in zip(self.heads, truths, strict=True):
            total = total + F.cross_entropy(head(cells), torch.full((len(cells),), truth))
            total = total + F.cross_entropy(head(pooled), torch.tensor([truth]))
        return total


def cell_rows(rows: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
    """The aligner rows among a span's ``rows`` (no start, newline or end)."""
    return rows[span_roles(plan.n_llm_h, plan.n_llm_w) == SpanRole.CELL]


def train_probe(
    model: DeepseekV41, heads: SceneHeads, cfg: VisionTrainConfig, say: Callable[[str], None]
) -> list[dict[str, float]]:
    """Stage 1: every aligner row -> shape, colour, background (``heads``).

    Each row is classified, not their mean: the bidirectional ViT learns to spread
    what the picture shows over every row, so the language model can read it from
    any of them, the span's last rows (within its sliding window of the question)
    included."""
    assert model.vision is not None and model.aligner is not None
    params = [*model.vision.parameters(), *model.aligner.parameters(), *heads.parameters()]
    opt = torch.optim.AdamW(params, lr=cfg.probe_lr, weight_decay=cfg.weight_decay)
    log: list[dict[str, float]] = []
    running = 0.0
    for step in range(cfg.probe_steps):
        image, scene = render_scene(step)
        processed = process_image(png_bytes(image), model.vision.vision)
        plan = processed.plan
        features = model.vision(processed.patches, plan.n_vit_h, plan.n_vit_w)
        loss = heads.loss(model.aligner(features, plan.n_vit_h, plan.n_vit_w), scene)
        loss.backward()
        loss = loss.detach()
        _step(opt, params, _lr(step, cfg.probe_steps, cfg, cfg.probe_lr), cfg.grad_clip)
        running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
        if step % 50 == 0 or step == cfg.probe_steps - 1:
            log.append({"step": step, "loss": round(running, 4)})
            say(f"probe {step}: loss {running:.3f}")
    return log


def chat_loss(
    model: DeepseekV41, ids: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """Mean cross-entropy of the ids under ``targets``, each predicted from the row
    before it (EOS weighted as the text stages weight it)."""
    kv = DenseKV(model.config, ids, ReplayPlan.exact(model.config), None, EXACT_KV, torch.float32)
    logits = model(ids, kv, image_embeds=rows)
    keep = targets[1:]
    return next_token_loss(logits[:-1][keep], ids[1:][keep], REPLAY_EOS_WEIGHT)


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
) -> list[dict[str, Any]]:
    """Stage 2: chats about pictures, through the language model (frozen unless
    ``cfg.text_lr``; then each step also takes a ``replay`` text sequence). The
    probe's ``heads`` keep training beside it (``cfg.probe_weight``), so the rows
    keep saying what the picture shows while the language model learns to read them."""
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
            rows = model.encode_image(processed.patches, processed.plan)
            loss = chat_loss(model, chat.ids, chat.targets, rows)
            if heads is not None and cfg.probe_weight:
                probe = heads.loss(cell_rows(rows, processed.plan).float(), scene)
                (loss + cfg.probe_weight * probe).backward()
            else:
                loss.backward()
            text_loss = None
            if replay is not None and cfg.replay_len:
                ids = replay.sample()
                text_loss = chat_loss(model, ids, torch.ones_like(ids, dtype=torch.bool), None)
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
) -> None:
    """``out_dir``: the tower, plus ``demo_dir``'s text tensors byte for byte (the
    trained ones when ``text_too``) and its drafter; the config with
    ``vision_config``; the tokenizer with the placeholder; ``training.json`` with
    ``record`` under ``vision_stage``."""
    tensors = trained_tensors(model, config, text_too)
    # Every name written anew replaces its old self (its scale rides along: an
    # encoded weight's scale is in ``tensors`` too).
    replace_tensors(demo_dir, out_dir, (*VISION_PREFIXES, *(tensors if text_too else ())), tensors)
    if demo_dir.resolve() != out_dir.resolve():
        shutil.copy(demo_dir / "tokenizer_config.json", out_dir / "tokenizer_config.json")
    write_config(out_dir, config)
    Tokenizer.from_str(json.dumps(tokenizer_data)).save(str(out_dir / "tokenizer.json"))
    record_stage(demo_dir, out_dir, "vision_stage", record)


def build_vision_stage(
    demo_dir: Path,
    out_dir: Path,
    cfg: VisionTrainConfig,
    *,
    vision: VisionConfig = DEMO_VISION,
    say: Callable[[str], None] = print,
    corpus_dir: Path = Path(".cache/corpus"),
) -> Path:
    """Train the tower on top of ``demo_dir``'s text model and write ``out_dir``."""
    started = time.monotonic()
    torch.manual_seed(cfg.seed)
    config, model, tokenizer, data = seeing_model(demo_dir, vision, cfg.seed, cfg.resume)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(f"tower: {trainable / 1e6:.2f} M trainable parameters, image id {model.image_token_id}")
    heads = SceneHeads(config.hidden_size)
    probe_log = train_probe(model, heads, cfg, say)
    replay = None
    if cfg.text_lr is not None and cfg.replay_len:
        replay = replay_sampler(tokenizer, cfg, corpus_dir)
    align_log = train_align(model, tokenizer, cfg, say, replay, heads)
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
    write_seeing_checkpoint(
        demo_dir, out_dir, config, model, data, record, text_too=cfg.text_lr is not None
    )
    say(f"wrote {out_dir} in {record['wall_seconds']:.0f} s")
    return out_dir
