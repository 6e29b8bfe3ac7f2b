from __future__ import annotations

import pytest
import torch

from engine.model.config import ModelConfig


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    """A random tiny model in fp32 with the real Engram vocabulary map."""
    from engine.model.engram import build_compressed_vocab
    from engine.model.model import DeepseekV41
    from engine.tokenizer import load_tokenizer

    torch.manual_seed(0)
    model = DeepseekV41(tiny_config)
    model.init_weights(torch.Generator().manual_seed(1234))
    # Larger-than-default weights make routing, top-k and candidate choices
    # depend visibly on the input, so the tests can tell paths apart.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attn_sink"):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()))
            elif "hc_" in name and name.endswith("_fn"):
                p.mul_(5.0)
    vocab_map, _ = build_compressed_vocab(load_tokenizer())
    model.set_compressed_vocab(vocab_map)
    return model.eval()
