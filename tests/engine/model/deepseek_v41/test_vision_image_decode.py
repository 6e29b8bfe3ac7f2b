"""Image decoding: the formats taken, the orientation, and every refusal typed."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest
from PIL import Image

from engine.model.deepseek_v41.vision.image_decode import (
    ImageError,
    ImageErrorKind,
    ImageLimits,
    decode_image,
)


def _encoded(image: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _red_left_blue_right(width: int = 40, height: int = 20) -> Image.Image:
    a = np.zeros((height, width, 3), np.uint8)
    a[:, : width // 2] = (255, 0, 0)
    a[:, width // 2 :] = (0, 0, 255)
    return Image.fromarray(a, "RGB")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_formats_decode_to_rgb(fmt: str) -> None:
    out = decode_image(_encoded(_red_left_blue_right(), fmt))
    assert out.mode == "RGB" and out.size == (40, 20)
    left, right = np.asarray(out)[10, 2], np.asarray(out)[10, 37]
    assert left[0] > 200 and left[2] < 60 and right[2] > 200 and right[0] < 60


def test_rgba_and_gray_become_rgb() -> None:
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 128))
    assert decode_image(_encoded(rgba, "PNG")).getpixel((0, 0)) == (10, 20, 30)
    gray = Image.new("L", (8, 8), 99)
    assert decode_image(_encoded(gray, "PNG")).getpixel((0, 0)) == (99, 99, 99)


def test_gif_takes_the_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), c) for c in [(255, 0, 0), (0, 255, 0)]]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    assert decode_image(buf.getvalue()).getpixel((4, 4))[0] > 200


def test_exif_orientation_is_applied() -> None:
    image = _red_left_blue_right(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: display turns it 90 degrees clockwise
    out = decode_image(_encoded(image, "JPEG", exif=exif.tobytes(), quality=95))
    assert out.size == (20, 40)
    top, bottom = np.asarray(out)[2, 10], np.asarray(out)[37, 10]
    assert top[0] > 200 and bottom[2] > 200  # red (the left) is now on top


def _kind(data: bytes, limits: ImageLimits | None = None) -> ImageErrorKind:
    with pytest.raises(ImageError) as err:
        decode_image(data, limits or ImageLimits())
    return err.value.kind


def test_too_many_bytes() -> None:
    data = _encoded(_red_left_blue_right(), "PNG")
    assert _kind(data, ImageLimits(max_bytes=len(data) - 1)) is ImageErrorKind.TOO_MANY_BYTES


def test_decompression_bomb_is_refused_from_its_header() -> None:
    """A 20000 x 20000 PNG of one colour is small on disk; its header is enough."""
    bomb = _encoded(Image.new("1", (20000, 20000)), "PNG")
    assert len(bomb) < 200_000
    start = time.perf_counter()
    assert _kind(bomb, ImageLimits(max_pixels=10_000_000)) is ImageErrorKind.TOO_MANY_PIXELS
    assert time.perf_counter() - start < 0.5  # nothing was decoded


def test_svg_non_image_and_other_formats_are_refused() -> None:
    svg = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>'
    assert _kind(svg) is ImageErrorKind.SVG
    assert _kind(b"<svg width='4'></svg>") is ImageErrorKind.SVG
    assert _kind(b"hello, not an image") is ImageErrorKind.NOT_AN_IMAGE
    assert _kind(b"") is ImageErrorKind.NOT_AN_IMAGE
    assert _kind(_encoded(_red_left_blue_right(), "BMP")) is ImageErrorKind.NOT_AN_IMAGE
    assert _kind(_encoded(_red_left_blue_right(), "TIFF")) is ImageErrorKind.NOT_AN_IMAGE


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_data_is_refused(fmt: str) -> None:
    noisy = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8))
    data = _encoded(noisy, fmt)
    assert _kind(data[: len(data) // 2]) is ImageErrorKind.CORRUPT
