"""The training loop: its learning-rate schedule by hand, and a tiny model memorising one
sequence (loss falls, held-out loss is logged, the QAT phase runs, masters stay fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.model import DeepseekV41
from training.trainer import TrainConfig, heldout_loss, learning_rate, train


def test_learning_rate_schedule() -> None:
    cfg = TrainConfig(steps=21, warmup_steps=5, lr=1.0, min_lr_ratio=0.1)
    assert [learning_rate(s, cfg) for s in range(5)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert learning_rate(5, cfg) == pytest.approx(1.0)  # cosine starts at the peak
    assert learning_rate(20, cfg) == pytest.approx(0.1)  # ... and ends at min_lr_ratio
    # Half way through the cosine: 0.1 + 0.9 * 0.5.
    assert learning_rate(5 + 15 // 2, cfg) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 15))
    )


class _OneSequence:
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def sample(self) -> torch.Tensor:
        return self.ids


def test_tiny_model_memorises_a_sequence() -> None:
    config = ModelConfig.tiny().replace(vocab_size=256)
    model = DeepseekV41(config)
    model.init_weights(torch.Generator().manual_seed(0))
    ids = torch.randint(3, 256, (25,), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(
        steps=6, micro_batches=1, seq_len=24, lr=1e-2, warmup_steps=1, eval_every=3,
        qat_from=0.8,  # the last step runs on served weights
    )  # fmt: skip
    before = heldout_loss(model, [ids])
    lines: list[str] = []
    result = train(model, _OneSequence(ids), [ids], cfg, lines.append)
    assert len(result.log) == 6 and len(lines) == 6
    assert [s.step for s in result.log if s.heldout_loss is not None] == [2, 5]
    assert result.log[-1].heldout_loss < 0.7 * before
    assert result.log[-1].loss < 0.7 * result.log[0].loss
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training
