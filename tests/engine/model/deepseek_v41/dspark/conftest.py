"""A tiny model with a two-stage drafter over two target layers (stage 0 holds the
context projection, stage 1 the heads: both roles are exercised), float64."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41


def two_stage_config() -> ModelConfig:
    tiny = ModelConfig.tiny()
    return dataclasses.replace(
        tiny,
        num_nextn_predict_layers=2,
        compress_ratios=[*tiny.compress_ratios, 0],
        dspark_target_layer_ids=[5, 7],
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
    )


@pytest.fixture(scope="session")
def model64() -> DeepseekV41:
    torch.manual_seed(0)
    model = DeepseekV41(two_stage_config())
    # A larger std than the default so the drafter's logits are not all near ties.
    model.init_weights(torch.Generator().manual_seed(3), std=0.05)
    return model.double().eval()
