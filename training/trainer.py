"""The demo's training loop: exact forward (semantics 1), AdamW, cosine schedule.

Per optimizer step, ``micro_batches`` sequences each run ``forward_train``
with unquantised KV; the loss is next-token cross-entropy plus the indexer's
KL (indexer_loss.py). Routers are balanced by their bias (router_balance.py).
From ``qat_from`` of the way on, forward and backward see the weights as the
checkpoint will store them (weight_qat.py), so the served model is the trained one.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from engine.model.base import CausalLM
from engine.model.deepseek_v41.reference import KVPrecision, forward, forward_train
from training.bpe import EOS_ID
from training.data import SequenceSampler
from training.indexer_loss import AttentionInputs, indexer_kl
from training.router_balance import RouterBalance
from training.weight_qat import quantised_weights

EXACT_KV = KVPrecision(global_kv="exact", swa="exact")


@dataclass(slots=True)
class TrainConfig:
    steps: int = 800
    micro_batches: int = 2  # sequences per optimizer step
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chat_fraction: float = 0.25
    tool_fraction: float = 0.0  # tool-call conversations (tool_data.py)
    qat_from: float = 0.7  # fraction of the steps after which weights are fake-quantised
    router_bias_rate: float = 5e-3
    eval_every: int = 100
    seed: int = 0
    # A wall-clock budget instead of a step count: the cosine decay and the switch to
    # quantised weights follow the elapsed fraction of it, and training stops when the
    # next step would overrun it (``steps`` is then only an upper bound). For a shared
    # machine whose speed is not known in advance; a run is then not reproducible
    # step for step.
    max_seconds: float | None = None
    # Weight of the cross-entropy at EOS targets (the end of a chat reply) against
    # 1 elsewhere; the loss is the weighted mean. A reply's end is one token in
    # hundreds, and what a served chat most needs right is where to stop.
    eos_weight: float = 1.0


@dataclass(slots=True)
class StepLog:
    step: int
    loss: float
    indexer_kl: float
    lr: float
    seconds: float
    max_load: float
    heldout_loss: float | None = None


@dataclass(slots=True)
class TrainResult:
    config: TrainConfig
    log: list[StepLog] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "log": [asdict(s) for s in self.log]}


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, eos_weight: float) -> torch.Tensor:
    """Cross-entropy over the positions, EOS targets weighted by ``eos_weight``
    (the weighted mean, so 1 gives the plain mean)."""
    ce = F.cross_entropy(logits, targets, reduction="none")
    if eos_weight == 1.0:
        return ce.mean()
    weights = torch.where(targets == EOS_ID, eos_weight, 1.0).to(ce.dtype)
    return (ce * weights).sum() / weights.sum()


def learning_rate(step: int, cfg: TrainConfig, progress: float | None = None) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at the last step.

    ``progress`` (0-1), when given, replaces the step's place in the decay (time budget).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if progress is None:
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _optimizer(model: CausalLM, cfg: TrainConfig) -> torch.optim.AdamW:
    """Weight decay on matrices only; the routers' biases are moved by RouterBalance."""
    decay: list[torch.nn.Parameter] = []
    plain: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if name.endswith("gate.bias"):
            p.requires_grad_(False)
            continue
        (decay if p.dim() >= 2 else plain).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": plain, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


@torch.no_grad()
def heldout_loss(model: CausalLM, windows: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy (nats) of the exact forward over ``windows``."""
    total, count = 0.0, 0
    for ids in windows:
        logits = forward(model, ids, precision=EXACT_KV).logits
        total += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        count += len(ids) - 1
    return total / count


def train(
    model: CausalLM,
    sampler: SequenceSampler,
    heldout: list[torch.Tensor],
    cfg: TrainConfig,
    say: Callable[[str], None] = print,
) -> TrainResult:
    torch.manual_seed(cfg.seed)
    model.train()
    optimizer = _optimizer(model, cfg)
    inputs = AttentionInputs(model)
    balance = RouterBalance(model, cfg.router_bias_rate)
    result = TrainResult(cfg)
    qat_step = round(cfg.qat_from * cfg.steps)
    began, last_seconds = time.monotonic(), 0.0
    try:
        for step in range(cfg.steps):
            started = time.monotonic()
            budget = cfg.max_seconds
            progress = None if budget is None else (started - began) / budget
            lr = learning_rate(step, cfg, progress)
            for group in optimizer.param_groups:
                group["lr"] = lr
            late = step >= qat_step if progress is None else progress >= cfg.qat_from
            qat = quantised_weights(model) if late else contextlib.nullcontext()
            with qat:
                lm, kl = 0.0, 0.0
                for _ in range(cfg.micro_batches):
                    ids = sampler.sample()
                    out = forward_train(model, ids[:-1], precision=EXACT_KV)
                    ce = next_token_loss(out.logits, ids[1:], cfg.eos_weight)
                    aux = indexer_kl(model, inputs.x, out.global_kv)
                    ((ce + aux) / cfg.micro_batches).backward()
                    lm += float(ce.detach()) / cfg.micro_batches
                    kl += float(aux.detach()) / cfg.micro_batches
                last = step == cfg.steps - 1 or (
                    budget is not None and started - began + 2 * last_seconds >= budget
                )
                evaluate = (step + 1) % cfg.eval_every == 0 or last
                held = heldout_loss(model, heldout) if evaluate else None
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            load = balance.update()
            entry = StepLog(step, lm, kl, lr, time.monotonic() - started, load, held)
            result.log.append(entry)
            last_seconds = entry.seconds
            say(
                f"step {step + 1}/{cfg.steps} loss {lm:.3f} indexer_kl {kl:.3f} lr {lr:.2e} "
                f"max_load {load:.2f} {entry.seconds:.1f}s"
                + (f" heldout {held:.3f} (ppl {math.exp(held):.1f})" if held is not None else "")
            )
            if last:
                break
    finally:
        inputs.remove()
        balance.remove()
    model.eval()
    return result
