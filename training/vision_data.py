"""Pictures the demo can learn to see on a CPU: one coloured shape on a plain background.

Each picture is drawn with Pillow from a seed alone (``render_scene``), so a seed
names a picture: the training stream takes seeds from one range and the held-out
evaluation from another. A scene is one of four shapes in one of six colours,
at a random place, size and (for the square, triangle and star) turn, the fill's
channels jittered, on a white, gray or black background whose shade is jittered
too. Pictures are 544 x 544: the release's ``min_pixels`` (295,936) exactly, so
the image processor neither scales them up nor down.

The questions and answers are short chat turns (``qa_turns``): the answer is the
colour or the shape, named once ("What colour is the circle?" -> "Red.").
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw

SIZE = 544
SHAPES = ("circle", "square", "triangle", "star")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "green": (40, 165, 60),
    "blue": (40, 70, 215),
    "yellow": (240, 215, 40),
    "purple": (135, 55, 175),
    "orange": (245, 135, 25),
}
BACKGROUNDS: dict[str, tuple[int, int]] = {  # name -> range of the gray level
    "white": (225, 255),
    "gray": (120, 170),
    "black": (0, 35),
}
# Per-channel fill jitter: small enough that no colour reaches a neighbour's centre.
FILL_JITTER = 18
# The turn that stands a shape upright, as a picture book draws it: the square's sides
# level, the triangle's and the star's point up (the probe's tests draw such scenes).
UPRIGHT = {"circle": 0.0, "square": 0.0, "triangle": -math.pi / 2, "star": -math.pi / 2}


@dataclass(frozen=True, slots=True)
class Scene:
    shape: str
    colour: str
    background: str
    centre: tuple[float, float]
    radius: float
    turn: float  # radians


def scene_of(seed: int) -> Scene:
    """The scene a seed draws: every choice from ``random.Random(seed)``."""
    rng = random.Random(seed)
    shape = rng.choice(SHAPES)
    colour = rng.choice(list(COLOURS))
    background = rng.choice(list(BACKGROUNDS))
    radius = rng.uniform(70, 170)
    centre = (rng.uniform(radius, SIZE - radius), rng.uniform(radius, SIZE - radius))
    return Scene(shape, colour, background, centre, radius, rng.uniform(0, 2 * math.pi))


def _polygon(scene: Scene) -> list[tuple[float, float]]:
    cx, cy = scene.centre
    r = scene.radius
    if scene.shape == "square":
        corners = [(r / math.sqrt(2), k * math.pi / 2 + math.pi / 4) for k in range(4)]
    elif scene.shape == "triangle":
        corners = [(r, k * 2 * math.pi / 3) for k in range(3)]
    else:  # a five-pointed star: outer and inner points alternate
        corners = [(r if k % 2 == 0 else r * 0.42, k * math.pi / 5) for k in range(10)]
    return [
        (cx + d * math.cos(a + scene.turn), cy + d * math.sin(a + scene.turn)) for d, a in corners
    ]


def _draw_shape(draw: ImageDraw.ImageDraw, scene: Scene, fill: tuple[int, ...]) -> None:
    if scene.shape == "circle":
        cx, cy = scene.centre
        r = scene.radius * 0.85  # a circle of the same radius looks larger than the others
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon(_polygon(scene), fill=fill)


def outline_normals(scene: Scene, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``points`` [N, 2] (x, y in the picture's pixels): each one's distance to the
    shape's outline and the angle of the outline's normal at its nearest point
    (radians, image axes: x right, y down)."""
    if scene.shape == "circle":
        d = points - torch.tensor(scene.centre, dtype=points.dtype)
        distance = (d.norm(dim=-1) - scene.radius * 0.85).abs()
        return distance, torch.atan2(d[:, 1], d[:, 0])
    corners = torch.tensor(_polygon(scene), dtype=points.dtype)
    best = torch.full((len(points),), math.inf, dtype=points.dtype)
    angle = torch.zeros(len(points), dtype=points.dtype)
    for a, b in zip(corners, corners.roll(-1, 0), strict=True):
        ab = b - a
        t = ((points - a) @ ab / (ab @ ab)).clamp(0, 1)
        distance = (points - (a + t[:, None] * ab)).norm(dim=-1)
        closer = distance < best
        best = torch.where(closer, distance, best)
        angle = torch.where(closer, math.atan2(float(ab[0]), -float(ab[1])), angle)
    return best, angle


def scene_mask(scene: Scene) -> Image.Image:
    """The shape's pixels of ``scene``'s picture: white where it is drawn, black elsewhere
    (the probe's per-cell targets)."""
    image = Image.new("RGB", (SIZE, SIZE), (0, 0, 0))
    _draw_shape(ImageDraw.Draw(image), scene, (255, 255, 255))
    return image


def render_scene(seed: int) -> tuple[Image.Image, Scene]:
    """The RGB picture of ``scene_of(seed)`` (the jitter also drawn from the seed)."""
    scene = scene_of(seed)
    rng = random.Random(seed ^ 0x5EED)
    low, high = BACKGROUNDS[scene.background]
    level = rng.randint(low, high)
    image = Image.new("RGB", (SIZE, SIZE), (level, level, level))
    fill = tuple(
        min(255, max(0, c + rng.randint(-FILL_JITTER, FILL_JITTER))) for c in COLOURS[scene.colour]
    )
    _draw_shape(ImageDraw.Draw(image), scene, fill)
    return image, scene


def png_bytes(image: Image.Image) -> bytes:
    """The picture as PNG: what a client would send (and what ``process_image`` takes)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def colour_question(scene: Scene) -> tuple[str, str]:
    return f"What colour is the {scene.shape}?", f"{scene.colour.capitalize()}."


def shape_question(scene: Scene) -> tuple[str, str]:
    return "What shape is this?", f"A {scene.shape}."


def _question_pool(scene: Scene) -> list[tuple[str, str]]:
    # Short answers: the text model is frozen, so the tower has to steer it into each
    # answer's words; the fewer there are, the fewer steps that takes.
    s, c, b = scene.shape, scene.colour, scene.background
    return [
        colour_question(scene),
        (f"What color is the {s}?", f"{c.capitalize()}."),
        ("What colour is it?", f"{c.capitalize()}."),
        shape_question(scene),
        ("What shape do you see?", f"A {s}."),
        ("What is in the picture?", f"A {c} {s}."),
        ("Describe the image.", f"A {c} {s} on {b}."),
        ("What colour is the background?", f"{b.capitalize()}."),
    ]


def qa_turns(seed: int, scene: Scene, turns: int) -> list[tuple[str, str]]:
    """``turns`` distinct (question, answer) pairs about ``scene``; the first is a colour
    or a shape question half the time each (the two the evaluation asks)."""
    rng = random.Random(seed ^ 0xA5A5)
    pool = _question_pool(scene)
    first = rng.choice([colour_question(scene), shape_question(scene), *pool[1:3], *pool[4:6]])
    rest = [qa for qa in pool if qa[0] != first[0]]
    rng.shuffle(rest)
    return [first, *rest[: turns - 1]]
