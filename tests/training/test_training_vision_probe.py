"""The vision stage's probe targets and its text replay's distillation.

Oracles: each cell's share of a circle computed from the geometry (sampled points,
in the processor's 546-pixel frame); the normals of upright outlines by hand
geometry; the cross-entropy of uniform guesses (ln of the class count, per term); a
teacher identical to the student (KL zero).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from engine.model.deepseek_v41.vision.image_plan import plan_image
from training.demo_config import demo_checkpoint_dir
from training.vision_data import BACKGROUNDS, COLOURS, SHAPES, SIZE, UPRIGHT, Scene
from training.vision_stage import (
    BACKGROUND,
    DEMO_VISION,
    EDGE,
    EDGE_SHARE,
    INSIDE,
    OUTLINE_HARMONICS,
    SceneHeads,
    cell_regions,
    distil_loss,
    patch_outlines,
    scene_targets,
    seeing_model,
)

CIRCLE = Scene("circle", "red", "white", centre=(250.0, 300.0), radius=160.0, turn=0.0)


def _circle_share(row: int, col: int, cell_px: float, samples: int = 24) -> float:
    """Share of the cell's area inside CIRCLE's drawn disc (radius x 0.85), the cell
    taken in the processed frame and mapped back to the picture's pixels."""
    scale = SIZE / (39 * 14)  # the picture is resized onto 39 x 39 whole patches
    cx, cy = CIRCLE.centre
    r = CIRCLE.radius * 0.85
    inside = 0
    for i in range(samples):
        for j in range(samples):
            x = (col * cell_px + (j + 0.5) * cell_px / samples) * scale
            y = (row * cell_px + (i + 0.5) * cell_px / samples) * scale
            inside += (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    return inside / samples**2


def test_cell_regions_follow_the_shapes_geometry() -> None:
    regions = cell_regions(CIRCLE, DEMO_VISION)
    side = 13  # 39 patches, 3 per cell
    assert regions.shape == (side * side,)
    low, high = EDGE_SHARE
    checked = 0
    for row in range(side):
        for col in range(side):
            share = _circle_share(row, col, 42.0)
            if min(abs(share - low), abs(share - high)) < 0.05:
                continue  # resampling decides cells this close to a threshold
            expected = BACKGROUND if share < low else INSIDE if share > high else EDGE
            assert int(regions[row * side + col]) == expected, (row, col, share)
            checked += 1
    assert checked > 150
    counts = torch.bincount(regions, minlength=3)
    assert counts[INSIDE] > 10 and counts[EDGE] > 10


def test_uniform_heads_cost_ln_of_each_terms_class_count() -> None:
    heads = SceneHeads(16, 8, outline_weight=4.0, row_shape=True)
    for p in heads.parameters():
        torch.nn.init.zeros_(p)
    plan = plan_image(SIZE, SIZE, DEMO_VISION)
    targets = scene_targets(CIRCLE, plan, DEMO_VISION)
    cells = torch.randn(len(targets.regions), 16)
    features = torch.randn(plan.n_patches, 8)
    loss = heads.loss(features, cells, CIRCLE, targets)
    colours, shapes, backgrounds = len(COLOURS), len(SHAPES), len(BACKGROUNDS)
    # The outline's harmonics are cos and sin pairs (mean square 1/2) against a zero
    # guess, weighted 4; then region, edge cells' shape, covered cells' colour,
    # background cells' shade, every row's shape and colour, the mean's.
    expected = 4 * 0.5 + sum(
        math.log(n) for n in (3, shapes, colours, backgrounds, shapes, colours, shapes, colours)
    )
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # Without the outline and every row's shape (the committed recipe's probe).
    plain = SceneHeads(16, 8)
    for p in plain.parameters():
        torch.nn.init.zeros_(p)
    without = expected - 4 * 0.5 - math.log(shapes)
    assert plain.loss(features, cells, CIRCLE, targets).item() == pytest.approx(without, rel=1e-6)
    # Without the per-cell and per-row targets: the outline and the mean's two.
    outline_only = SceneHeads(16, 8, outline_weight=4.0, cell_targets=False)
    for p in outline_only.parameters():
        torch.nn.init.zeros_(p)
    mean_only = 4 * 0.5 + math.log(shapes) + math.log(colours)
    got = outline_only.loss(features, cells, CIRCLE, targets).item()
    assert got == pytest.approx(mean_only, rel=1e-6)
    # A head that names the truth lowers its term: the targets reach the heads.
    with torch.no_grad():
        heads.region.bias[BACKGROUND] = 1.0  # most cells are background
    assert heads.loss(features, cells, CIRCLE, targets).item() < expected
    with torch.no_grad():
        heads.region.bias.zero_()
        heads.picture_shape.bias[SHAPES.index("square")] = 5.0  # a wrong shape: dearer
    assert heads.loss(features, cells, CIRCLE, targets).item() > expected


@pytest.mark.parametrize(
    ("shape", "harmonic", "value"),
    [("square", 4, 1.0), ("triangle", 6, -1.0), ("star", 10, None)],
)
def test_an_upright_outlines_normals_share_one_harmonic(shape, harmonic, value) -> None:
    # Hand geometry: level sides have normals at multiples of 90 degrees (cos 4a = 1);
    # an upright triangle's at 90 + 120k (cos 6a = -1); a star's ten sides come in
    # mirrored pairs turned by 72 degrees (cos 10a the same on all of them).
    scene = Scene(shape, "red", "white", (272.0, 272.0), 150.0, UPRIGHT[shape])
    on, harmonics = patch_outlines(scene, plan_image(SIZE, SIZE, DEMO_VISION))
    column = 2 * OUTLINE_HARMONICS.index(harmonic)
    cos = harmonics[on, column]
    expected = cos[0].item() if value is None else value
    assert torch.allclose(cos, torch.full_like(cos, expected), atol=1e-5)
    assert value is not None or abs(expected) > 0.5


def test_a_circles_outline_patches_ring_it() -> None:
    plan = plan_image(SIZE, SIZE, DEMO_VISION)
    on, harmonics = patch_outlines(CIRCLE, plan)
    # A band one patch wide along the circumference: about 2 pi r / 14 patches.
    expected = 2 * math.pi * CIRCLE.radius * 0.85 * (39 * 14 / SIZE) / 14
    assert abs(int(on.sum()) - expected) < 0.15 * expected
    # Each one's normal points from the centre: its cos 2a is cos(2 atan2(dy, dx)).
    scale = SIZE / (39 * 14)
    idx = on.nonzero().flatten()
    rows, cols = idx // 39, idx % 39
    dx = (cols + 0.5) * 14 * scale - CIRCLE.centre[0]
    dy = (rows + 0.5) * 14 * scale - CIRCLE.centre[1]
    angle = torch.atan2(dy.double(), dx.double()).float()
    assert torch.allclose(harmonics[on, 0], torch.cos(2 * angle), atol=1e-4)


def test_distillation_is_zero_against_itself_and_trains_only_the_student() -> None:
    _, model, tokenizer, _ = seeing_model(demo_checkpoint_dir(), DEMO_VISION, seed=0)
    teacher = copy.deepcopy(model).requires_grad_(False).eval()
    ids = torch.tensor(tokenizer.encode("To be, or not to be", add_special_tokens=False).ids)
    assert distil_loss(model, teacher, ids).item() == pytest.approx(0.0, abs=1e-6)

    name = "layers.2.attn.wo_b.weight"
    params = dict(model.named_parameters())
    params[name].requires_grad_(True)
    with torch.no_grad():
        params[name].add_(0.05 * torch.randn_like(params[name]))
    loss = distil_loss(model, teacher, ids)
    assert loss.item() > 1e-4
    loss.backward()
    assert params[name].grad is not None and params[name].grad.abs().sum() > 0
    assert all(p.grad is None for p in teacher.parameters())
