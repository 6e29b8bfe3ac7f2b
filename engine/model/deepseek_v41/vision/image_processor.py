"""Image bytes -> what the engine needs of one image: its plan, its patches, its hash.

Decoding (``image_decode``), the plan (``image_plan``) and the pixels
(``image_pixels``) in one call, plus a content hash of the decoded pixels: two
images with the same pixels feed the ViT the same patches (whatever container
carried them), so a cache keyed by the hash may share their work; any differing
pixel gives another hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3
import torch
from PIL import Image

from engine.model.deepseek_v41.vision.config import VisionConfig
from engine.model.deepseek_v41.vision.image_decode import DEFAULT_LIMITS, ImageLimits, decode_image
from engine.model.deepseek_v41.vision.image_pixels import image_patches
from engine.model.deepseek_v41.vision.image_plan import ImagePlan, plan_image


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    plan: ImagePlan
    patches: torch.Tensor  # [plan.n_patches, 3 * patch^2] float32, the ViT's input
    content_hash: bytes  # 32 bytes, blake3 of the decoded RGB image and its size

    @property
    def tokens(self) -> int:
        return self.plan.tokens


def pixel_hash(image: Image.Image) -> bytes:
    """blake3 of ``width, height`` and the RGB bytes: the size is in it so that two
    images with the same bytes in other shapes differ."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    h = blake3.blake3()
    h.update(rgb.width.to_bytes(4, "little") + rgb.height.to_bytes(4, "little"))
    h.update(rgb.tobytes())
    return h.digest()


def process_image(
    data: bytes, vision: VisionConfig, limits: ImageLimits = DEFAULT_LIMITS
) -> ProcessedImage:
    """Decode ``data`` (``ImageError`` if refused), plan it under ``vision`` and cut its patches."""
    image = decode_image(data, limits)
    plan = plan_image(image.width, image.height, vision)
    return ProcessedImage(plan, image_patches(image, plan), pixel_hash(image))
