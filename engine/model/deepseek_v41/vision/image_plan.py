"""The resize plan: how many pixels, patches and tokens an image of a given size gets.

Pure functions of the image's size and the release's processor settings
(``vision_config``), so a token count is known before a pixel is decoded:

1. an image under ``min_pixels`` is scaled up, keeping its aspect, to about
   ``min_pixels``; a larger one is never scaled down here;
2. both sides round up to whole ``patch_size`` patches: the box the image is fitted into;
3. ``downsample_ratio`` x ``downsample_ratio`` patches merge into one image token
   (a partial cell at the right or bottom edge still makes a token), and the span
   costs ``T = n_h * (n_w + 1) + 2`` tokens: a newline after every row of tokens,
   a start and an end;
4. when ``T`` exceeds ``max_image_tokens`` the box shrinks, in closed form, to the
   largest aspect-preserving grid that fits (below).

The numbers match the public ports (docs/design/model-notes.md, "Images").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.model.deepseek_v41.vision.config import VisionConfig


@dataclass(frozen=True, slots=True)
class ImagePlan:
    """What one image becomes. ``box_*``: the pixel size fed to the ViT."""

    width: int  # the decoded image's size
    height: int
    box_width: int
    box_height: int
    patch_size: int
    downsample_ratio: int
    # True when ``max_wh_ratio`` caps a very wide image: it is stretched into the
    # box instead of fitted and padded (off for the release: max_wh_ratio is null).
    squeeze: bool = False

    @property
    def n_vit_h(self) -> int:
        return self.box_height // self.patch_size

    @property
    def n_vit_w(self) -> int:
        return self.box_width // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.n_vit_h * self.n_vit_w

    @property
    def n_llm_h(self) -> int:
        return -(-self.n_vit_h // self.downsample_ratio)

    @property
    def n_llm_w(self) -> int:
        return -(-self.n_vit_w // self.downsample_ratio)

    @property
    def n_cells(self) -> int:
        """Aligner rows: one per image token that is not a start, newline or end."""
        return self.n_llm_h * self.n_llm_w

    @property
    def tokens(self) -> int:
        """Positions of the image's span in the prompt."""
        return span_tokens(self.n_llm_h, self.n_llm_w)


def span_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """``n_h`` rows of ``n_w`` cells and a newline each, between a start and an end."""
    return n_llm_h * (n_llm_w + 1) + 2


def _grid(box_h: int, box_w: int, patch: int, ratio: int) -> tuple[int, int]:
    return -(-(box_h // patch) // ratio), -(-(box_w // patch) // ratio)


def _shrink(
    height: float, width: float, patch: int, ratio: int, max_tokens: int
) -> tuple[int, int]:
    """The largest box of the image's aspect whose span fits ``max_tokens``.

    With ``r = height / width`` and ``b`` cells per row, about ``r * b`` rows fill
    the image, so the span costs ``r * b * (b + 1) + 2``; the largest real ``b``
    within budget solves ``r b^2 + r b = max_tokens - 2``:
    ``b = sqrt((max_tokens - 2) / r + 1/4) - 1/2``. Whole cells of both sides scale
    the image by the smaller of the two ratios; the box is then cut to whole patches.
    A grid that cannot hold one cell along a side collapses to a single column (or row).
    """
    r = height / width
    cols = math.sqrt((max_tokens - 2) / r + 0.25) - 0.5
    rows = cols * r
    cell = patch * ratio
    if cols < 1.0:  # taller than one column of cells can show
        return (max_tokens - 2) // 2 * cell, cell
    if rows < 1.0:  # wider than one row of cells can show
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return (
        math.floor(height * scale / patch) * patch,
        math.floor(width * scale / patch) * patch,
    )


def plan_image(width: int, height: int, vision: VisionConfig) -> ImagePlan:
    """The plan of an image ``width`` x ``height`` pixels (steps 1-4 of the module doc)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width}x{height}: both sides must be positive")
    patch, ratio = vision.patch_size, vision.downsample_ratio
    w: float = width
    h: float = height
    cap = vision.max_wh_ratio
    squeeze = cap is not None and width >= cap * height
    if cap is not None and w > h * cap:
        w = h * cap
    if w * h < vision.min_pixels:
        up = math.sqrt(vision.min_pixels / (w * h))
        w, h = int(w * up), int(h * up)
    box_w = math.ceil(w / patch) * patch
    box_h = math.ceil(h / patch) * patch
    n_h, n_w = _grid(box_h, box_w, patch, ratio)
    if span_tokens(n_h, n_w) > vision.max_image_tokens:
        box_h, box_w = _shrink(h, w, patch, ratio, vision.max_image_tokens)
        n_h, n_w = _grid(box_h, box_w, patch, ratio)
        if span_tokens(n_h, n_w) > vision.max_image_tokens or min(box_h, box_w) <= 0:
            raise ValueError(
                f"image size {width}x{height}: no box fits {vision.max_image_tokens} image tokens"
            )
    return ImagePlan(width, height, box_w, box_h, patch, ratio, squeeze)


def fitted_size(width: int, height: int, box_width: int, box_height: int) -> tuple[int, int]:
    """(width, height) of the image scaled to fit the box, aspect kept: the side that
    binds is the box's, the other is rounded to the nearest pixel."""
    image_ratio, box_ratio = width / height, box_width / box_height
    if image_ratio > box_ratio:
        return box_width, round(height / width * box_width)
    if image_ratio < box_ratio:
        return round(width / height * box_height), box_height
    return box_width, box_height
