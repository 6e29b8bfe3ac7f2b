"""Distil a DSpark drafter for a frozen target on the target's own greedy outputs.

The target generates greedy continuations of prompts; one dense forward over each
sequence records its ``dspark_target_layer_ids`` block inputs. Each training
example is one drafting round at an anchor position ``p``: the context rows
before ``p`` (the last window), the block after ``seq[p]``, and the target's
next ``B`` tokens as labels. The Markov head is trained teacher-forced (slot j's
predecessor is the target's token ``p + j``), the confidence head on whether the
slot's greedy choice is the label. Only ``model.mtp`` learns; the embedding and
head it reads are the target's, frozen.

Acceptance is measured as a speculative decoder would see it: rounds of ``k``
greedy drafts against the target's greedy continuation, the next round's anchor
after the accepted prefix and the bonus token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.deepseek_v41.dspark.drafter import DSparkDrafter
from engine.model.deepseek_v41.model import DeepseekV41


@dataclass(frozen=True, slots=True)
class DistillConfig:
    steps: int = 600
    batch: int = 8  # rounds per optimiser step
    lr: float = 2e-3
    seed: int = 0
    confidence_weight: float = 0.1
    # Wall-clock budget: the first ``WARMUP`` steps are timed and ``steps`` is cut to
    # what fits, so the schedule is a function of the step count alone and a run with
    # ``steps`` set to the count it reached (no budget) repeats it exactly.
    max_seconds: float | None = None


WARMUP = 20  # steps of linear warm-up (also the steps a budget's step time is taken over)


@dataclass(slots=True)
class Rollout:
    """A prompt and its greedy continuation (``tokens``), the target layers' block
    inputs at every row (``features[l]`` [len, hc, D]), and where the continuation starts."""

    tokens: list[int]
    features: dict[int, torch.Tensor]
    start: int


@torch.no_grad()
def greedy_rollout(model: DeepseekV41, prompt: list[int], new_tokens: int) -> Rollout:
    """The target's greedy continuation of ``prompt`` and its block inputs."""
    ids = list(prompt)
    for _ in range(new_tokens):
        ids.append(int(model(torch.tensor(ids))[-1].argmax()))
    feats, _ = block_inputs(model, ids)
    return Rollout(ids, feats, len(prompt))


@torch.no_grad()
def block_inputs(
    model: DeepseekV41, tokens: list[int]
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """One dense forward over ``tokens``: the ``dspark_target_layer_ids`` blocks'
    inputs [len, hc, D] and the logits [len, vocab]."""
    feats: dict[int, torch.Tensor] = {}
    hooks = [
        model.block(l).register_forward_pre_hook(
            lambda m, args, l=l: feats.__setitem__(l, args[0].detach())
        )
        for l in model.config.dspark_target_layer_ids
    ]
    try:
        logits = model(torch.tensor(tokens))
    finally:
        for h in hooks:
            h.remove()
    return feats, logits


def attach_drafter(
    model: DeepseekV41, seed: int = 0, warm_from: DeepseekV41 | None = None
) -> DSparkDrafter:
    """A fresh drafter on ``model`` (``model.mtp``), warm-started where it can be.

    Each stage starts as a copy of the target's last layer (the first experts, their
    router rows), so the block begins where the target's own computation ends; the
    context projection averages the target layers; the Markov bias starts at zero.
    ``warm_from``: the same target loaded unpacked (``quantization="none"``), when
    ``model`` holds packed weights (their stored bytes are no values to copy).
    """
    drafter = DSparkDrafter(model.config).to(model.embed.weight.dtype)
    g = torch.Generator().manual_seed(seed)
    source = warm_from if warm_from is not None else model
    last = source.block(model.config.num_hidden_layers - 1).state_dict()
    with torch.no_grad():
        for name, p in drafter.state_dict(keep_vars=True).items():
            local = name.split(".", 1)[1]
            src = last.get(local)
            if src is not None and src.shape == p.shape:
                p.copy_(src)
            elif local.startswith("ffn.gate.") and src is None:
                p.zero_()
            elif local.startswith("ffn.gate.") and last[local].dim() >= 1:
                p.copy_(last[local][: p.shape[0]])
            elif local.endswith("norm.weight"):
                p.fill_(1.0)
            elif local == "main_proj.weight":
                n = len(model.config.dspark_target_layer_ids)
                eye = torch.eye(p.shape[0], dtype=p.dtype)
                p.copy_(torch.cat([eye / n] * n, dim=1))
            elif local == "markov_head.head.weight" or local == "confidence_head.proj.weight":
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.02)
    model.mtp = drafter
    return drafter


def round_logits(model: DeepseekV41, r: Rollout, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, V], confidence [B]) of the round at anchor ``p``, teacher-forced."""
    drafter = model.mtp
    assert drafter is not None
    lo = max(0, p - drafter.window)
    feats = {l: f[lo:p] for l, f in r.features.items()}
    rings = drafter.context_kv(drafter.context(feats), torch.arange(lo, p))
    base, h = drafter([r.tokens[p]], [p], [rings], model.embed, model.head)
    last = drafter.stages[-1]
    assert last.markov_head is not None and last.confidence_head is not None
    B = drafter.block_size
    code = last.markov_head.code(torch.tensor(r.tokens[p : p + B]))
    logits = base + last.markov_head.bias(code)
    return logits, last.confidence_head(h, code)


def distill(
    model: DeepseekV41,
    rollouts: list[Rollout],
    cfg: DistillConfig,
    say: Callable[[str], None] = print,
) -> list[float]:
    """Train ``model.mtp`` on ``rollouts``; returns the loss of every step."""
    drafter = model.mtp
    assert drafter is not None
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(drafter.parameters())
    for p in params:
        p.requires_grad_(True)
    # The target's embedding and head are read, not trained (they are not drafter tensors).
    model.embed.weight.requires_grad_(False)
    model.head.weight.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(cfg.seed)
    B = drafter.block_size
    anchors = [(i, p) for i, r in enumerate(rollouts) for p in range(1, len(r.tokens) - B)]
    losses: list[float] = []
    total_steps = cfg.steps
    started = time.monotonic()
    step = 0
    while step < total_steps:
        if cfg.max_seconds is not None and step == WARMUP:
            per_step = (time.monotonic() - started) / WARMUP
            total_steps = max(WARMUP + 1, min(cfg.steps, int(cfg.max_seconds / per_step)))
            say(f"dspark distill: {per_step * 1e3:.0f} ms a step, {total_steps} steps in budget")
        lr = cfg.lr * lr_factor(step, total_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        total = 0.0
        for j in torch.randint(len(anchors), (cfg.batch,), generator=g).tolist():
            i, p = anchors[j]
            r = rollouts[i]
            logits, conf = round_logits(model, r, p)
            labels = torch.tensor(r.tokens[p + 1 : p + 1 + B])
            ce = F.cross_entropy(logits, labels)
            hit = (logits.argmax(-1) == labels).to(conf.dtype)
            bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), hit)
            loss = (ce + cfg.confidence_weight * bce) / cfg.batch
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(total)
        if step % 100 == 0 or step == total_steps - 1:
            say(f"dspark distill step {step}: loss {total:.3f}")
        step += 1
    for p in params:
        p.requires_grad_(False)
    return losses


def lr_factor(step: int, total_steps: int) -> float:
    """Linear warm-up over ``WARMUP`` steps, then linear decay to 0.1 at ``total_steps``;
    the warm-up steps do not depend on ``total_steps`` (a budget fixes it after them)."""
    warm = min(1.0, (step + 1) / WARMUP)
    span = max(1, total_steps - WARMUP)
    return warm * (0.1 + 0.9 * (1 - max(0, step - WARMUP) / span))


@torch.no_grad()
def acceptance(model: DeepseekV41, rollouts: list[Rollout], k: int) -> tuple[float, list[float]]:
    """(mean acceptance length = accepted + 1 per round, acceptance rate per position)
    of ``k``-token greedy rounds over each rollout's continuation."""
    drafter = model.mtp
    assert drafter is not None
    lengths: list[int] = []
    per_pos = [0] * k
    for r in rollouts:
        p = r.start - 1  # the first round drafts after the prompt's last token
        while p + k < len(r.tokens):
            lo = max(0, p - drafter.window)
            feats = {l: f[lo:p] for l, f in r.features.items()}
            rings = drafter.context_kv(drafter.context(feats), torch.arange(lo, p))
            out = drafter.draft(r.tokens[p], p, rings, model.embed, model.head)
            drafts = out.tokens[:k].tolist()
            accepted = 0
            while accepted < k and drafts[accepted] == r.tokens[p + 1 + accepted]:
                per_pos[accepted] += 1
                accepted += 1
            lengths.append(accepted + 1)
            p += accepted + 1
    rounds = max(1, len(lengths))
    return sum(lengths) / rounds, [c / rounds for c in per_pos]
