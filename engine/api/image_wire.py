"""An image of a request as it travels between processes (msgspec, msgpack).

The API process sends each ``ImageInput`` to the engine core, and the core sends
it on to the parallel workers that run the vision tower: the plan's fields, the
patches as float32 bytes with their shape, and the content hash. The receiver
rebuilds the same ``ProcessedImage`` (bit for bit: the bytes are the tensor's).
"""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from engine.api.request import ImageInput
from engine.model.deepseek_v41.vision.image_plan import ImagePlan
from engine.model.deepseek_v41.vision.image_processor import ProcessedImage


class WireImage(msgspec.Struct, array_like=True):
    offset: int
    plan: ImagePlan  # a frozen dataclass: msgspec sends its fields
    patches: bytes  # float32, C order
    shape: list[int]
    content_hash: bytes


def wire_image(item: ImageInput) -> WireImage:
    patches = item.image.patches.detach().to("cpu", torch.float32).contiguous()
    return WireImage(
        offset=item.offset,
        plan=item.image.plan,
        patches=patches.numpy().tobytes(),
        shape=list(patches.shape),
        content_hash=item.image.content_hash,
    )


def image_of(msg: WireImage) -> ImageInput:
    array = np.frombuffer(msg.patches, dtype=np.float32).reshape(msg.shape)
    patches = torch.from_numpy(array.copy())
    return ImageInput(msg.offset, ProcessedImage(msg.plan, patches, msg.content_hash))
