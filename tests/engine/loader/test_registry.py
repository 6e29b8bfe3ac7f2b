"""The model registry: the official config's model_type resolves to DeepSeek-V4.1;
an unknown one is refused naming the known ones; a registered second entry is the
model the loader and the builder build, its checkpoint written and read by its
own weight rules."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.config import EngineConfig
from engine.loader.builder import build_engine
from engine.loader.checkpoint import empty_model, load_checkpoint
from engine.loader.checkpoint_writer import make_tiny, save_checkpoint
from engine.loader.files import SINGLE_FILE
from engine.loader.formats import CheckpointError, dequantize
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
from engine.model.weights import WeightFormat, WeightRules, scale_name

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
    """DeepSeek-V4.1's rules but for two: its checkpoint stores the output head as
    FP8 blocks (DeepSeek's: BF16) and holds ``toy_extra.*`` tensors it does not serve."""
    base = model_spec("deepseek_v41")
    weights = WeightRules(
        formats=((re.compile(r"head\.weight"), WeightFormat.FP8_BLOCK), *base.weights.formats),
        skipped_kinds=(*base.weights.skipped_kinds, ("toy-extra", ("toy_extra.",))),
        optional_tensors=base.weights.optional_tensors,
    )
    spec = ModelSpec("toy_v41", ModelConfig, ToyV41, base.params, weights, base.loading)
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


def test_a_registered_entry_brings_its_own_weight_rules(
    tmp_path: Path, toy: ModelSpec, caplog: pytest.LogCaptureFixture
) -> None:
    config = ModelConfig.tiny()
    model = ToyV41(config)
    model.init_weights(torch.Generator().manual_seed(4))
    extras = {"toy_extra.table": torch.zeros(2, 2, dtype=torch.bfloat16)}
    out = save_checkpoint(model, config, tmp_path / "toy", extra_tensors=extras, spec=toy)
    assert json.loads((out / "config.json").read_text(encoding="utf-8"))["model_type"] == "toy_v41"
    stored = load_file(out / SINGLE_FILE)
    # The writer took the toy's rule: the head as E4M3 with its E8M0 block scales.
    assert stored["head.weight"].dtype == torch.float8_e4m3fn
    assert stored[scale_name("head.weight")].dtype == torch.float8_e8m0fnu
    head = dequantize(
        WeightFormat.FP8_BLOCK,
        stored["head.weight"],
        stored[scale_name("head.weight")],
        torch.float32,
    )

    with caplog.at_level(logging.INFO, logger="engine.loader.checkpoint"):
        _, loaded = load_checkpoint(out, quantization="none")
    assert type(loaded) is ToyV41
    assert torch.equal(loaded.head.weight, head)
    assert "skipped 1 toy-extra tensors" in caplog.text

    # The same files read by DeepSeek-V4.1's rules: its head has no FP8 scale and
    # it has no ``toy_extra`` kind, so both stored tensors are unexpected there.
    data = json.loads((out / "config.json").read_text(encoding="utf-8"))
    (out / "config.json").write_text(json.dumps({**data, "model_type": "deepseek_v41"}))
    with pytest.raises(CheckpointError, match=r"unexpected in the checkpoint.*\(2 in all\)") as exc:
        load_checkpoint(out, quantization="none")
    assert exc.value.tensor == "head.scale"
