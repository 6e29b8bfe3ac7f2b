"""Image bytes -> an RGB Pillow image, refusing what must not be decoded.

The checks run in the order that keeps a hostile input cheap: the byte count;
SVG (text, never rasterised here); the container's header (PNG, JPEG, WebP or
GIF only, Pillow's ``formats=``), whose size is checked against the pixel limit
before a single pixel is decoded (a decompression bomb stays a header); then the
decode itself, where truncated or corrupt data is refused. The first frame of
an animated GIF is the image; EXIF orientation is applied.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from enum import StrEnum

from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

# Formats we decode; everything else (TIFF, BMP, ICO, PSD, ...) is refused.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")

# Defaults of the limits; an operator may lower them.
DEFAULT_MAX_IMAGE_BYTES = 20 << 20
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000


class ImageErrorKind(StrEnum):
    TOO_MANY_BYTES = "too_many_bytes"
    TOO_MANY_PIXELS = "too_many_pixels"
    SVG = "svg"
    NOT_AN_IMAGE = "not_an_image"
    CORRUPT = "corrupt"


class ImageError(ValueError):
    """An image the server refuses; ``kind`` says why (an API answers it with a 400)."""

    def __init__(self, kind: ImageErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS


def _looks_like_svg(data: bytes) -> bool:
    head = data[:1024].lstrip().lower()
    return head.startswith(b"<svg") or (head.startswith(b"<?xml") and b"<svg" in head)


DEFAULT_LIMITS = ImageLimits()


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """The image in ``data`` as RGB, upright; ``ImageError`` for anything refused."""
    if len(data) > limits.max_bytes:
        raise ImageError(
            ImageErrorKind.TOO_MANY_BYTES,
            f"image is {len(data)} bytes, over the limit of {limits.max_bytes}",
        )
    if _looks_like_svg(data):
        raise ImageError(ImageErrorKind.SVG, "SVG images are not supported")
    # Never decode what a truncated stream leaves out (a process-wide Pillow switch).
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    with warnings.catch_warnings():
        # Pillow warns (and past twice its own limit, raises) on huge headers;
        # our limit below is the one that answers.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
        except Image.DecompressionBombError as exc:
            raise ImageError(ImageErrorKind.TOO_MANY_PIXELS, str(exc)) from exc
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
            raise ImageError(
                ImageErrorKind.NOT_AN_IMAGE, "not a PNG, JPEG, WebP or GIF image"
            ) from exc
        width, height = image.size
        if width <= 0 or height <= 0:
            raise ImageError(ImageErrorKind.CORRUPT, f"image has size {width}x{height}")
        if width * height > limits.max_pixels:
            raise ImageError(
                ImageErrorKind.TOO_MANY_PIXELS,
                f"image is {width}x{height} = {width * height} pixels, "
                f"over the limit of {limits.max_pixels}",
            )
        try:
            image.seek(0)  # an animation's first frame
            image.load()
            upright = ImageOps.exif_transpose(image)
            return upright.convert("RGB")
        except (OSError, ValueError, SyntaxError, EOFError) as exc:
            raise ImageError(ImageErrorKind.CORRUPT, f"image data is corrupt: {exc}") from exc
