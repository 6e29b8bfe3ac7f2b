"""An RGB image and its plan -> the ViT's patches.

The image is fitted into the plan's box (bicubic, aspect kept, the binding side
exact) and centred on gray 127; values are normalised as ``(x / 255 - 0.5) / 0.5``
and cut into ``patch x patch`` patches in reading order, each flattened
channel-major ``(channel, row, column)``: the layout ``vision.patch_embed.proj``
multiplies.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from engine.model.deepseek_v41.vision.image_plan import ImagePlan, fitted_size

PAD_GRAY = 127


def boxed_image(image: Image.Image, plan: ImagePlan) -> Image.Image:
    """``image`` (RGB) resized into ``plan``'s box: fitted and centred on gray, or
    stretched when the plan squeezes a very wide image."""
    box = (plan.box_width, plan.box_height)
    if plan.squeeze:
        return image.resize(box, Image.Resampling.BICUBIC)
    fitted = fitted_size(image.width, image.height, *box)
    resized = image if fitted == image.size else image.resize(fitted, Image.Resampling.BICUBIC)
    if fitted == box:
        return resized
    canvas = Image.new("RGB", box, (PAD_GRAY, PAD_GRAY, PAD_GRAY))
    # Centred; an odd margin leaves the extra pixel after (Python rounds halves to even).
    canvas.paste(resized, (round((box[0] - fitted[0]) * 0.5), round((box[1] - fitted[1]) * 0.5)))
    return canvas


def normalised(image: Image.Image) -> torch.Tensor:
    """[3, H, W] float32 in [-1, 1]."""
    x = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1)
    return (x / 255.0 - 0.5) / 0.5


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [H/p * W/p, 3 * p * p]: patches row by row, each channel-major."""
    c, h, w = pixels.shape
    if h % patch or w % patch:
        raise ValueError(f"{h}x{w} pixels are not whole {patch}-pixel patches")
    grid = pixels.reshape(c, h // patch, patch, w // patch, patch)
    return grid.permute(1, 3, 0, 2, 4).reshape((h // patch) * (w // patch), c * patch * patch)


def image_patches(image: Image.Image, plan: ImagePlan) -> torch.Tensor:
    """The ViT input of ``image`` under ``plan``: [plan.n_patches, 3 * p * p] float32."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    return patchify(normalised(boxed_image(image, plan)), plan.patch_size)
