"""The training loop: its learning-rate schedule by hand, and a tiny model memorising one
sequence (loss falls, held-out loss is logged, the QAT phase runs, masters stay fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
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


def test_learning_rate_follows_progress_when_given() -> None:
    cfg = TrainConfig(steps=1000, warmup_steps=5, lr=1.0, min_lr_ratio=0.1)
    assert learning_rate(2, cfg, progress=0.9) == pytest.approx(0.6)  # warm-up is by step
    assert learning_rate(50, cfg, progress=0.5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert learning_rate(50, cfg, progress=1.0) == pytest.approx(0.1)
    assert learning_rate(50, cfg, progress=1.7) == pytest.approx(0.1)  # past the budget


class _Clock:
    """A monotonic clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = -1.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


def test_a_time_budget_ends_the_run_and_drives_the_schedule(monkeypatch) -> None:
    import training.trainer as trainer

    monkeypatch.setattr(trainer, "time", _Clock())
    config = ModelConfig.tiny().replace(vocab_size=256)
    model = DeepseekV41(config)
    model.init_weights(torch.Generator().manual_seed(0))
    ids = torch.randint(3, 256, (25,), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(
        steps=100, micro_batches=1, seq_len=24, lr=1.0, warmup_steps=1, eval_every=50,
        min_lr_ratio=0.1, max_seconds=10.0,
    )  # fmt: skip
    result = train(model, _OneSequence(ids), [ids], cfg, lambda _: None)
    # Clock reads: start 0; step k starts at 1 + 2k and lasts 1 s. Step k is the last when
    # the next one would overrun: 1 + 2k + 2 * 1 >= 10, so k = 4 (five steps).
    assert [s.step for s in result.log] == [0, 1, 2, 3, 4]
    assert [s.heldout_loss is not None for s in result.log] == [False] * 4 + [True]
    cosine = [0.1 + 0.45 * (1 + math.cos(math.pi * (1 + 2 * k) / 10)) for k in range(1, 5)]
    assert [s.lr for s in result.log] == pytest.approx([1.0, *cosine])


def test_next_token_loss_weights_eos_targets() -> None:
    from training.bpe import EOS_ID
    from training.trainer import next_token_loss

    torch.manual_seed(0)
    logits = torch.randn(5, 9)
    targets = torch.tensor([3, EOS_ID, 4, EOS_ID, 0])
    per_position = [-float(torch.log_softmax(logits[i], -1)[t]) for i, t in enumerate(targets)]
    assert float(next_token_loss(logits, targets, 1.0)) == pytest.approx(
        sum(per_position) / 5, rel=1e-6
    )
    weights = [3.0 if int(t) == EOS_ID else 1.0 for t in targets]
    expected = sum(w * c for w, c in zip(weights, per_position, strict=True)) / sum(weights)
    assert float(next_token_loss(logits, targets, 3.0)) == pytest.approx(expected, rel=1e-6)
