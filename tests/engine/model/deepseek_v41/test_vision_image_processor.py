"""One call from bytes to plan, patches and content hash."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from engine.model.deepseek_v41.vision.config import VisionConfig
from engine.model.deepseek_v41.vision.image_decode import ImageError, ImageErrorKind
from engine.model.deepseek_v41.vision.image_pixels import image_patches
from engine.model.deepseek_v41.vision.image_plan import plan_image
from engine.model.deepseek_v41.vision.image_processor import process_image

RELEASE = VisionConfig()


def _noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8), "RGB")


def _bytes(image: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_plan_and_patches_are_those_of_the_decoded_image() -> None:
    image = _noise(640, 480)
    out = process_image(_bytes(image, "PNG"), RELEASE)
    assert out.tokens == 206 and out.plan == plan_image(640, 480, RELEASE)
    assert torch.equal(out.patches, image_patches(image, out.plan))


def test_same_pixels_hash_alike_whatever_the_container() -> None:
    image = _noise(64, 48)
    png = process_image(_bytes(image, "PNG"), RELEASE)
    webp = process_image(_bytes(image, "WEBP", lossless=True), RELEASE)
    assert png.content_hash == webp.content_hash and len(png.content_hash) == 32
    changed = np.asarray(image).copy()
    changed[10, 10, 0] ^= 1  # one bit of one pixel
    other = process_image(_bytes(Image.fromarray(changed, "RGB"), "PNG"), RELEASE)
    assert other.content_hash != png.content_hash
    # The same bytes laid out in another shape are another image.
    flat = Image.frombytes("RGB", (48, 64), image.tobytes())
    assert process_image(_bytes(flat, "PNG"), RELEASE).content_hash != png.content_hash


def test_refusals_pass_through_typed() -> None:
    with pytest.raises(ImageError) as err:
        process_image(b"GIF89a-but-not-really", RELEASE)
    assert err.value.kind is ImageErrorKind.NOT_AN_IMAGE
