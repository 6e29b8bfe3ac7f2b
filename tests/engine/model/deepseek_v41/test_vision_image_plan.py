"""The resize plan and the pixels it produces.

Token costs are the public ports' (docs/design/model-notes.md, "Images"); the
pixels are checked against Pillow's own fit-and-pad (``ImageOps.pad``), a second
code path to ours, and the patch layout against a per-patch loop.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from engine.model.deepseek_v41.vision.config import VisionConfig
from engine.model.deepseek_v41.vision.image_pixels import boxed_image, image_patches
from engine.model.deepseek_v41.vision.image_plan import plan_image, span_tokens

RELEASE = VisionConfig()


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    [
        (640, 480, 206),
        (640, 420, 189),
        (1000, 800, 502),
        (1920, 1080, 968),
        (2500, 2000, 1010),
        (20, 16, 194),
    ],
)
def test_token_costs_of_the_public_ports(width: int, height: int, tokens: int) -> None:
    assert plan_image(width, height, RELEASE).tokens == tokens


def test_640x480_by_hand() -> None:
    """No upscale (307,200 >= 295,936 pixels); 35 x 46 patches; 12 x 16 tokens, a newline each."""
    plan = plan_image(640, 480, RELEASE)
    assert (plan.box_width, plan.box_height) == (644, 490)
    assert (plan.n_vit_h, plan.n_vit_w, plan.n_llm_h, plan.n_llm_w) == (35, 46, 12, 16)
    assert plan.tokens == 12 * 17 + 2
    assert plan.n_cells == 12 * 16


def test_small_images_scale_up_and_large_never_down() -> None:
    small = plan_image(20, 16, RELEASE)
    assert small.box_width * small.box_height >= RELEASE.min_pixels
    # 1000x800 costs 502 tokens, within budget: its box is the image rounded up.
    big = plan_image(1000, 800, RELEASE)
    assert (big.box_width, big.box_height) == (1008, 812)


@pytest.mark.parametrize(("width", "height"), [(1, 4000), (4000, 1), (1, 1), (10000, 10000)])
def test_extreme_sizes_fit_the_budget(width: int, height: int) -> None:
    plan = plan_image(width, height, RELEASE)
    assert 4 <= plan.tokens <= RELEASE.max_image_tokens
    assert plan.box_width % 14 == 0 and plan.box_height % 14 == 0
    assert plan.box_width > 0 and plan.box_height > 0


def test_a_tall_sliver_collapses_to_one_column_of_the_whole_budget() -> None:
    plan = plan_image(1, 4000, RELEASE)
    assert plan.n_llm_w == 1
    assert plan.tokens == RELEASE.max_image_tokens  # 511 rows of (1 cell + newline) + 2


def test_shrunk_plans_use_the_budget_well() -> None:
    """A shrunk box is the largest of its aspect: one more cell per side would not fit."""
    for w, h in [(1920, 1080), (2500, 2000), (4000, 3000), (3000, 4000)]:
        plan = plan_image(w, h, RELEASE)
        assert plan.tokens <= 1024
        assert span_tokens(plan.n_llm_h + 1, plan.n_llm_w + 1) > 1024
        assert abs(plan.box_width / plan.box_height - w / h) < 0.05


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        plan_image(0, 10, RELEASE)


def _gradient(width: int, height: int) -> Image.Image:
    x = np.arange(width)[None, :, None] * 7 + np.arange(height)[:, None, None] * 3
    rgb = np.concatenate([x % 256, (x // 2) % 256, (255 - x % 256)], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


@pytest.mark.parametrize(("width", "height"), [(640, 480), (20, 16), (1920, 1080), (300, 700)])
def test_pixels_match_pillows_fit_and_pad(width: int, height: int) -> None:
    image = _gradient(width, height)
    plan = plan_image(width, height, RELEASE)
    ours = boxed_image(image, plan)
    theirs = ImageOps.pad(
        image, (plan.box_width, plan.box_height), Image.Resampling.BICUBIC, color=(127, 127, 127)
    )
    assert ours.size == (plan.box_width, plan.box_height)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


def test_patches_are_normalised_reading_order_channel_major() -> None:
    image = _gradient(640, 420)
    plan = plan_image(640, 420, RELEASE)
    patches = image_patches(image, plan)
    assert patches.shape == (plan.n_patches, 588)
    pixels = np.asarray(boxed_image(image, plan), dtype=np.float64)  # [H, W, 3]
    p = 14
    for index in (0, 1, plan.n_vit_w, plan.n_patches - 1):
        r, c = divmod(index, plan.n_vit_w)
        block = pixels[r * p : (r + 1) * p, c * p : (c + 1) * p, :]
        expected = [
            (block[i, j, ch] / 255 - 0.5) / 0.5
            for ch in range(3)
            for i in range(p)
            for j in range(p)
        ]
        assert torch.allclose(patches[index].double(), torch.tensor(expected), atol=1e-6)
    # The pad is gray 127: just under zero after normalisation.
    assert torch.isclose(patches[0, 0], torch.tensor(127 / 255 * 2 - 1), atol=1e-6)
