"""The model registry: the official config's model_type resolves to DeepSeek-V4.1;
an unknown one is refused naming the known ones; a registered second entry is the
model the loader and the builder build."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.loader.builder import build_engine
from engine.loader.checkpoint import empty_model, load_checkpoint
from engine.loader.checkpoint_writer import make_tiny
from engine.model.deepseek_v41.config import ConfigError, ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.registry import (
    ModelSpec,
    known_model_types,
    model_spec,
    read_config,
    register,
    spec_of,
    unregister,
)

OFFICIAL = resources.files("engine.model.deepseek_v41").joinpath(
    "data/deepseek-v4.1-flash.config.json"
)


def test_the_official_config_resolves_to_deepseek_v41() -> None:
    model_type = json.loads(OFFICIAL.read_text(encoding="utf-8"))["model_type"]
    spec = model_spec(model_type)
    assert spec.model_type == model_type == "deepseek_v41"
    assert spec.config_class is ModelConfig and spec.model_class is DeepseekV41
    found, config = read_config(Path(str(OFFICIAL)))
    assert found is spec and config == ModelConfig.official()
    assert spec_of(config) is spec
    assert model_type in known_model_types()


def test_an_unknown_model_type_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown model type 'llama'; known: deepseek_v41"):
        model_spec("llama")
    data = json.loads(OFFICIAL.read_text(encoding="utf-8"))
    (tmp_path / "config.json").write_text(json.dumps({**data, "model_type": "llama"}))
    with pytest.raises(ConfigError, match="known: deepseek_v41") as exc:
        read_config(tmp_path)
    assert exc.value.field == "model_type"
    del data["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="names no model_type; known: deepseek_v41"):
        read_config(tmp_path)


class ToyV41(DeepseekV41):
    """A second variant: DeepSeek-V4.1's modules under another model type."""


@pytest.fixture
def toy() -> Iterator[ModelSpec]:
    base = model_spec("deepseek_v41")
    spec = ModelSpec("toy_v41", ModelConfig, ToyV41, base.params)
    register(spec)
    yield spec
    unregister("toy_v41")


def test_a_registered_entry_is_what_the_loader_and_builder_build(
    tmp_path: Path, toy: ModelSpec
) -> None:
    assert "toy_v41" in known_model_types()
    checkpoint = make_tiny(tmp_path / "deepseek", seed=2)
    toy_dir = tmp_path / "toy"
    shutil.copytree(checkpoint, toy_dir)
    config = json.loads((toy_dir / "config.json").read_text(encoding="utf-8"))
    (toy_dir / "config.json").write_text(json.dumps({**config, "model_type": "toy_v41"}))

    _, loaded = load_checkpoint(toy_dir)
    _, original = load_checkpoint(checkpoint)
    assert type(loaded) is ToyV41 and type(original) is DeepseekV41
    ids = torch.arange(12)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids), original.eval()(ids))
    engine = build_engine(EngineConfig(kv_cache_bytes=8 << 20, max_num_seqs=1), toy_dir)
    assert type(engine.runner.model) is ToyV41
    # A config object of the default class still plans and builds as DeepSeek-V4.1.
    assert type(empty_model(ModelConfig.tiny(), device="meta")) is DeepseekV41
