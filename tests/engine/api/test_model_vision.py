"""The engine clients' vision facts come from the config the engine loads: a checkpoint
with ``vision_config`` takes images (its processor settings and placeholder id), one
without, and the in-process random "tiny" preset, do not."""

from __future__ import annotations

import json
from pathlib import Path

from engine.api.model_vision import ModelVision, model_vision
from engine.loader.checkpoint_writer import tiny_checkpoint_config
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.vision.config import VisionConfig


def _checkpoint(root: Path, config: ModelConfig) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config.to_dict()), encoding="utf-8")
    return root


def test_a_checkpoint_with_a_vision_tower_takes_images(tmp_path: Path) -> None:
    config = tiny_checkpoint_config()
    facts = model_vision(_checkpoint(tmp_path / "vl", config))
    assert facts == ModelVision(VisionConfig.tiny(), config.extra["image_token_id"])
    # The release's processor settings, whatever the tower's size.
    assert (facts.config.patch_size, facts.config.downsample_ratio) == (14, 3)
    assert (facts.config.min_pixels, facts.config.max_image_tokens) == (295_936, 1024)


def test_text_only_models_take_none(tmp_path: Path) -> None:
    assert model_vision(_checkpoint(tmp_path / "text", ModelConfig.tiny())) is None
    assert model_vision("tiny") is None
