"""Drafter distillation: the drafter learns its target's greedy continuation and the
target's own tensors stay byte-identical (the target is frozen)."""

from __future__ import annotations

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from training.dspark_distill import (
    DistillConfig,
    Rollout,
    attach_drafter,
    distill,
    greedy_rollout,
    round_logits,
)


@torch.no_grad()
def _rounds_loss(model: DeepseekV41, r: Rollout) -> float:
    assert model.mtp is not None
    B = model.mtp.block_size
    losses = [
        float(
            torch.nn.functional.cross_entropy(
                round_logits(model, r, p)[0], torch.tensor(r.tokens[p + 1 : p + 1 + B])
            )
        )
        for p in range(1, len(r.tokens) - B)
    ]
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_distill_learns_the_rollout_and_leaves_the_target_alone() -> None:
    torch.manual_seed(0)
    model = DeepseekV41(ModelConfig.tiny())
    model.init_weights(torch.Generator().manual_seed(0))
    model.drop_drafter()
    rollout = greedy_rollout(model, [5, 9, 13, 17, 21, 25], 6)
    assert len(rollout.tokens) == 12 and rollout.features[7].shape[0] == 12
    drafter = attach_drafter(model)
    # Warm start: the stage begins as the target's last layer.
    assert torch.equal(drafter.stages[0].attn.wq_a.weight, model.block(7).attn.wq_a.weight)
    target = {n: t.clone() for n, t in model.state_dict().items() if not n.startswith("mtp.")}
    before = _rounds_loss(model, rollout)
    distill(model, [rollout], DistillConfig(steps=12, batch=2, lr=5e-3), say=lambda s: None)
    # Every round of the rollout, teacher-forced, deterministic: the loss fell.
    assert _rounds_loss(model, rollout) < 0.85 * before
    after = model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in target.items())
    assert not torch.equal(drafter.stages[0].attn.wq_a.weight, model.block(7).attn.wq_a.weight)
