"""Quantisation-aware weights equal what the checkpoint loader returns (save then load is
the oracle), and the master weights come back untouched with the gradients kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.loader.checkpoint import load_checkpoint
from engine.loader.checkpoint_writer import save_checkpoint
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from training.weight_qat import lossy, quantised_weights

# A small embedding: fast (the DSpark noise id moves inside the smaller vocabulary).
CONFIG = ModelConfig.tiny().replace(vocab_size=512, dspark_noise_token_id=3)


@pytest.fixture(scope="module")
def model() -> DeepseekV41:
    model = DeepseekV41(CONFIG)
    model.init_weights(torch.Generator().manual_seed(5))
    return model


def test_swapped_weights_are_the_loaded_checkpoint(tmp_path: Path, model: DeepseekV41) -> None:
    config = CONFIG
    # Checkpoint names (routed experts one by one); the loader dequantises every
    # tensor, the value QAT trains against.
    masters = {n: t.clone() for n, t in model.state_dict().items()}
    save_checkpoint(model, config, tmp_path)
    _, loaded = load_checkpoint(tmp_path, quantization="none")
    served = loaded.state_dict()

    with quantised_weights(model):
        changed = 0
        for name, p in model.state_dict().items():
            assert torch.equal(p, served[name]), name
            changed += not torch.equal(p, masters[name])
        assert changed > 0.5 * sum(lossy(n) for n in masters)  # most lossy weights moved
        expert = "layers.1.ffn.experts.3.w2.weight"
        assert lossy(expert) and not torch.equal(model.state_dict()[expert], masters[expert])
    for name, p in model.state_dict().items():
        assert torch.equal(p, masters[name]), name


def test_gradients_computed_on_served_weights_stay_for_the_master(model: DeepseekV41) -> None:
    config = CONFIG
    weight = model.layers[0].attn.wq_a.weight
    master = weight.detach().clone()
    x = torch.randn(3, config.hidden_size)
    one_layer = nn.Module()  # same parameter names as the model's, one layer to quantise
    one_layer.layers = nn.ModuleList([model.layers[0]])
    with quantised_weights(one_layer):
        served = weight.detach().clone()
        (x @ weight.T).sum().backward()
    assert not torch.equal(served, master)
    assert torch.equal(weight, master)
    # d/dW sum(x W^T) = column sums of x, whichever value W held.
    torch.testing.assert_close(weight.grad, x.sum(0).expand_as(weight))


def test_fp32_parameters_are_not_lossy() -> None:
    assert not lossy("layers.0.hc_attn_fn")
    assert not lossy("layers.0.attn.attn_sink")
    assert lossy("layers.0.ffn.experts.3.w1.weight")
    assert lossy("embed.weight")  # stored as BF16
