"""Drafter distillation: the drafter learns its target's greedy continuation and the
target's own tensors stay byte-identical (the target is frozen)."""

from __future__ import annotations

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from training.dspark_distill import DistillConfig, attach_drafter, distill, greedy_rollout


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
    losses = distill(
        model, [rollout], DistillConfig(steps=12, batch=2, lr=5e-3), say=lambda s: None
    )
    assert losses[-1] < 0.7 * losses[0]
    after = model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in target.items())
    assert not torch.equal(drafter.stages[0].attn.wq_a.weight, model.block(7).attn.wq_a.weight)
