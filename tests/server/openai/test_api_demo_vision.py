"""The demo's eyes over the API: a chat whose user message holds a held-out picture
(an ``image_url`` data URL, as the openai SDK sends it) and a question gets the
picture's colour and shape back, through the served path (CED prefill, FP4 global
KV, FP8 SWA, the paged runner), not only the dense forward the stage trained under.

Oracle: the seed's scene (training/vision_data.py), none of whose pictures the
vision stage trained on. The goal is 90% on 100 pictures (docs/QUALITY.md); on
these eight the test asks at least seven of each kind, while chance is one or two.
The demo reads colour; its shape answers are at chance, which the shape test
records as an expected failure (strict: it fails the suite once shape is read,
so the mark cannot outlive the gap).
"""

from __future__ import annotations

import base64
import json

import pytest
from fastapi.testclient import TestClient

from engine.api.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.app import create_app
from server.settings import ServerSettings
from training.demo_config import demo_checkpoint_dir
from training.vision_data import (
    COLOURS,
    SHAPES,
    colour_question,
    png_bytes,
    render_scene,
    shape_question,
)
from training.vision_eval import HELDOUT_SEED_BASE, first_word_of

DEMO = demo_checkpoint_dir()
PICTURES = 8
AT_LEAST = 7

pytestmark = pytest.mark.skipif(
    "vision_config" not in json.loads((DEMO / "config.json").read_text(encoding="utf-8")),
    reason="models/demo has no vision tower yet",
)


def _served_answers() -> tuple[dict[str, int], list[tuple[int, str, str, str]]]:
    """Right answers per kind over the held-out pictures, and every reply."""
    engine = AsyncEngine(EngineConfig(max_num_seqs=4, kv_cache_bytes=64 << 20), DEMO)
    right = {"colour": 0, "shape": 0}
    replies = []
    try:
        with TestClient(create_app(engine, ServerSettings())) as client:
            for seed in range(HELDOUT_SEED_BASE, HELDOUT_SEED_BASE + PICTURES):
                image, scene = render_scene(seed)
                url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
                for kind, ask, words, truth in (
                    ("colour", colour_question, list(COLOURS), scene.colour),
                    ("shape", shape_question, list(SHAPES), scene.shape),
                ):
                    content = [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": ask(scene)[0]},
                    ]
                    body = {
                        "model": "deepseek-chat",
                        "messages": [{"role": "user", "content": content}],
                        "max_tokens": 8,
                        "temperature": 0,
                    }
                    response = client.post("/v1/chat/completions", json=body)
                    assert response.status_code == 200, response.text
                    reply = response.json()["choices"][0]["message"]["content"]
                    right[kind] += first_word_of(reply, words) == truth
                    replies.append((seed, kind, truth, reply))
    finally:
        engine.shutdown()
    return right, replies


@pytest.fixture(scope="module")
def served() -> tuple[dict[str, int], list[tuple[int, str, str, str]]]:
    return _served_answers()


def test_the_served_demo_names_the_colour_of_held_out_pictures(served) -> None:
    right, replies = served
    assert right["colour"] >= AT_LEAST, (right, replies)
    # Every reply to a question about a picture is a picture's answer, not verse.
    assert all(first_word_of(r[3], list(COLOURS) + list(SHAPES)) for r in replies), replies


@pytest.mark.xfail(
    strict=True,
    reason="a known gap: the demo's tower names colour but not yet shape (27% of 100 "
    "held-out pictures, chance 25%; docs/QUALITY.md, 'Why shape is not read yet'); "
    "strict, so the mark goes as soon as shape is read",
)
def test_the_served_demo_names_the_shape_of_held_out_pictures(served) -> None:
    right, replies = served
    assert right["shape"] >= AT_LEAST, (right, replies)
