"""bench/restore_drift.py: restore and recompute agree to rounding on a random tiny model,
and the measure sees a wrong stored prefix (the same KV from other text)."""

from __future__ import annotations

import torch

from bench import restore_drift
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.reference import ReplayPlan


def _model() -> DeepseekV41:
    model = DeepseekV41(ModelConfig.tiny().replace(vocab_size=64))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.eval()


def test_restore_matches_recompute_to_rounding() -> None:
    model = _model()
    ids = torch.randint(3, 64, (48,), generator=torch.Generator().manual_seed(1))
    assert restore_drift.max_drift(model, ids, 40, 32) < 1e-4


def test_a_wrong_stored_prefix_shows(monkeypatch) -> None:
    model = _model()
    g = torch.Generator().manual_seed(2)
    ids, other = torch.randint(3, 64, (48,), generator=g), torch.randint(3, 64, (48,), generator=g)
    real = restore_drift.forward

    def forward(model, tokens, plan, kv, precision):
        # The exact pass (no stored KV, full plan) reads the other text: the held prefix is wrong.
        if plan == ReplayPlan.exact(model.config):
            tokens = other
        return real(model, tokens, plan, kv, precision)

    monkeypatch.setattr(restore_drift, "forward", forward)
    assert restore_drift.max_drift(model, ids, 40, 32) > 1e-3
