"""What a served model says about images: its ``VisionConfig`` and placeholder id.

A server builds image prompts from these two facts (the resize plan needs the
processor settings; the span carries the placeholder id), so both engine clients
expose them next to ``max_model_len``. They are read from the same config the
engine loads: a checkpoint directory's config.json, or the in-process random
"tiny" preset (which has no vision tower; ``flashserve serve --model tiny``
writes a checkpoint whose config has one).

The image processing a server runs before a request reaches the engine
(decode, resize plan, patches, content hash) is the model's own code,
re-exported here: the server reaches the engine through ``engine.api`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.model.deepseek_v41.vision.config import (
    IMAGE_TOKEN,
    VisionConfig,
    image_token_id,
    vision_config,
)
from engine.model.deepseek_v41.vision.image_decode import ImageError, ImageErrorKind, ImageLimits
from engine.model.deepseek_v41.vision.image_processor import ProcessedImage, process_image

__all__ = [
    "IMAGE_PLACEHOLDER",
    "ImageError",
    "ImageErrorKind",
    "ImageLimits",
    "ModelVision",
    "ProcessedImage",
    "model_vision",
    "process_image",
]

# The placeholder's spelling in prompt text (a server writes it once per image).
IMAGE_PLACEHOLDER = IMAGE_TOKEN


@dataclass(frozen=True, slots=True)
class ModelVision:
    """A model that takes images: its processor settings and the span's placeholder id."""

    config: VisionConfig
    image_token_id: int


def model_vision(model: str | Path) -> ModelVision | None:
    """The vision facts of ``model`` ("tiny" or a checkpoint directory); None: text only."""
    if str(model) == "tiny":
        return None  # the in-process preset is the text model only
    from engine.model.registry import read_config

    _, config = read_config(Path(model))
    vision = vision_config(config)
    token = image_token_id(config)
    if vision is None or token is None:
        return None
    return ModelVision(vision, token)
