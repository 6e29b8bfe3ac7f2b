"""make-tiny's vision tower: the release's layout and image-processor settings, a small tower.

The oracle for the settings is the release's config.json values written out here
(patch 14, downsample 3, ``min_pixels`` 295,936, 1,024 image tokens), not
``VisionConfig``'s defaults, so a changed default fails too. The tower's stored
names and formats are the release's (the loader's end-to-end read of a make-tiny
checkpoint is tests/engine/loader/test_checkpoint.py's); here the tower is built on
the meta device, so no weight is made.
"""

from __future__ import annotations

import pytest
import torch

from engine.loader.checkpoint_writer import tiny_checkpoint_config
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.vision.aligner import Aligner
from engine.model.deepseek_v41.vision.config import vision_config
from engine.model.deepseek_v41.vision.vit import VisionTransformer
from engine.model.registry import spec_of
from engine.model.weights import WeightFormat

RELEASE_PROCESSOR = {
    "patch_size": 14,
    "downsample_ratio": 3,
    "min_pixels": 295936,
    "max_image_tokens": 1024,
}


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return tiny_checkpoint_config()


def test_tiny_keeps_the_release_processor_and_shrinks_the_tower(config: ModelConfig) -> None:
    vision = config.extra["vision_config"]
    assert {k: vision[k] for k in RELEASE_PROCESSOR} == RELEASE_PROCESSOR
    assert vision["hidden_size"] < 1024 and vision["num_hidden_layers"] < 32


def test_tiny_tower_has_the_releases_names_shapes_and_formats(config: ModelConfig) -> None:
    vision = vision_config(config)
    assert vision is not None
    # The model's tower modules under its attribute names (``vision.``, ``aligner.``).
    with torch.device("meta"):
        tower = {
            "vision": VisionTransformer(vision),
            "aligner": Aligner(vision, config.hidden_size),
        }
    shapes = {
        f"{prefix}.{n}": tuple(t.shape)
        for prefix, module in tower.items()
        for n, t in module.state_dict().items()
    }
    rules = spec_of(config).weights
    width, hidden = vision.hidden_size, config.hidden_size
    assert shapes["vision.patch_embed.proj.weight"] == (width, 3 * 14 * 14)
    for i in range(vision.num_hidden_layers):
        block = f"vision.blocks.{i}."
        assert shapes[block + "attn.wqkv.weight"] == (3 * width, width)
        assert shapes[block + "attn.wqkv.bias"] == (3 * width,)
        assert shapes[block + "mlp.w1.weight"] == (2 * vision.intermediate_size, width)
        assert rules.format_of(block + "norm1.weight") is WeightFormat.FP32
        assert rules.format_of(block + "attn.wqkv.weight") is WeightFormat.BF16
    assert shapes["aligner.w1.weight"] == (hidden, width * 3 * 3)
    assert shapes["aligner.w2.weight"] == (hidden, hidden)
    assert all(rules.is_vision(n) for n in shapes)
    for name in ("image_start", "image_newline", "image_end"):
        assert rules.format_of(name) is WeightFormat.FP32 and rules.is_vision(name)
