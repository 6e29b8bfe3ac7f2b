"""Shared fixtures of the engine tests: one random tiny model per session."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="session")
def tiny_model(tiny_config):
    """A random tiny model in fp32 with the real Engram vocabulary map.

    Larger-than-default attention sinks and mHC weights make routing, top-k and
    candidate choices depend visibly on the input (as in tests/engine/model).
    """
    from engine.loader.tokenizer import load_tokenizer
    from engine.model.deepseek_v41.engram import build_compressed_vocab
    from engine.model.deepseek_v41.model import DeepseekV41

    torch.manual_seed(0)
    model = DeepseekV41(tiny_config)
    model.init_weights(torch.Generator().manual_seed(1234))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attn_sink"):
                p.copy_(torch.linspace(-1.0, 1.0, p.numel()))
            elif "hc_" in name and name.endswith("_fn"):
                p.mul_(5.0)
    vocab_map, _ = build_compressed_vocab(load_tokenizer())
    model.set_compressed_vocab(vocab_map)
    return model.eval()


@pytest.fixture(scope="session")
def engine_model(tiny_model):
    """``tiny_model`` with embeddings scaled by 10.

    Token identity then dominates the residual stream, so greedy streams vary
    from token to token instead of settling on one id: a stream comparison can
    tell a wrong plan or a wrong KV byte from the right one.
    """
    model = copy.deepcopy(tiny_model)
    with torch.no_grad():
        model.embed.weight.mul_(10.0)
    return model.eval()


@pytest.fixture(scope="session")
def engine_checkpoint(engine_model, tmp_path_factory):
    """``engine_model`` saved with the tiny tokenizer: what the parallel serving tests'
    worker ranks load (and their single-process oracle), its DSpark drafter included."""
    from engine.loader.checkpoint_writer import save_checkpoint, write_tiny_tokenizer

    out = save_checkpoint(engine_model, engine_model.config, tmp_path_factory.mktemp("varied"))
    write_tiny_tokenizer(out, engine_model.config)
    return out


def _cached_oracle(model):
    """``reference_generate`` on ``model``, cached: many tests share prompts."""
    from engine.model.deepseek_v41.reference import reference_generate

    cache: dict = {}

    def run(tokens: list[int], n: int, **kw):
        # ``stored`` is left out of the key: in these tests it is a function of
        # the prompt, the precision and ``stored_tokens``, which are in it.
        options = sorted((k, repr(v)) for k, v in kw.items() if k != "stored")
        key = (tuple(tokens), n, tuple(options))
        if key not in cache:
            cache[key] = reference_generate(model, tokens, n, **kw)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def oracle(engine_model):
    return _cached_oracle(engine_model)


@pytest.fixture(scope="session")
def engine_model64(engine_model):
    """``engine_model`` in float64, for the paged runner's comparisons (see
    tests/engine/runner/test_model_runner.py: in fp32, rounding noise can tip FP4
    codes and top-k choices; in float64 it cannot)."""
    return copy.deepcopy(engine_model).double().eval()


@pytest.fixture(scope="session")
def oracle64(engine_model64):
    return _cached_oracle(engine_model64)


@dataclass(frozen=True)
class Flavour:
    """Which runner an engine test drives, with the model and oracle it is held to."""

    runner: str
    model: object
    oracle: object


@pytest.fixture(params=["reference", "paged"])
def flavour(request, engine_model, oracle, engine_model64, oracle64) -> Flavour:
    """The dense ReferenceRunner in fp32, and the production PagedModelRunner in float64."""
    if request.param == "reference":
        return Flavour("reference", engine_model, oracle)
    return Flavour("paged", engine_model64, oracle64)
