"""Images for the image tests: encoded bytes, data URLs, a PNG header that lies about
its size, and a planning context on a tokenizer that has the image placeholder."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path

from PIL import Image

from engine.api.model_vision import IMAGE_PLACEHOLDER, ModelVision
from engine.loader.checkpoint_writer import tiny_checkpoint_config, write_tiny_tokenizer
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.vision.config import VisionConfig

# Span lengths of the release's resize plan for these sizes (the public ports' numbers).
TOKENS_640x480 = 206
TOKENS_20x16 = 194


def png(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, object]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def bomb_png(width: int = 60_000, height: int = 60_000) -> bytes:
    """A PNG whose header says ``width x height`` and whose data is one tiny row: a
    decoder that trusted the header would allocate gigabytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def tiny_vision_tokenizer(out: Path) -> tuple[object, ModelVision]:
    """The tiny checkpoint's tokenizer (it spells the placeholder as one token) and the
    tiny checkpoint's vision facts (the release's processor settings)."""
    write_tiny_tokenizer(out, ModelConfig.tiny())
    tokenizer = load_tokenizer(out)
    token_id = tiny_checkpoint_config().extra["image_token_id"]
    assert tokenizer.token_to_id(IMAGE_PLACEHOLDER) == token_id
    return tokenizer, ModelVision(VisionConfig.tiny(), token_id)
