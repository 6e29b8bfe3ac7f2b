"""The committed demo checkpoint sees: its tower loads from the release's tensor names,
and greedy decoding through the dense forward names the colour of held-out pictures.

The pictures are the first held-out seeds of bench/vision_quality.py (none trained on);
the oracle is the seed's scene (training/vision_data.py), not the model. The module
runs once models/demo carries a trained tower (``flashserve train-demo --stage
vision``); the committed demo is still text-only (docs/QUALITY.md says why).
"""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from engine.loader.checkpoint import load_checkpoint
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.vision.config import IMAGE_TOKEN, vision_config
from engine.model.deepseek_v41.vision.image_processor import process_image
from training.demo_config import demo_checkpoint_dir
from training.vision_chat import prompt_ids
from training.vision_data import COLOURS, colour_question, png_bytes, render_scene
from training.vision_eval import HELDOUT_SEED_BASE, first_word_of, greedy_answer

DEMO = demo_checkpoint_dir()
# The tower, aligner and span vectors stay small beside the 17.6 MB text model.
MAX_TOWER_BYTES = 5 << 20

pytestmark = pytest.mark.skipif(
    "vision_config" not in json.loads((DEMO / "config.json").read_text(encoding="utf-8")),
    reason="models/demo has no vision tower yet",
)


@pytest.fixture(scope="module")
def demo():
    config, model = load_checkpoint(DEMO, quantization="none")
    return config, model.eval(), load_tokenizer(DEMO)


def test_the_demo_has_a_tower_in_the_releases_layout(demo) -> None:
    config, model, tokenizer = demo
    vision = vision_config(config)
    assert vision is not None and model.takes_images
    # The release's image-processor settings; only the tower is small.
    assert (vision.patch_size, vision.downsample_ratio) == (14, 3)
    assert (vision.min_pixels, vision.max_image_tokens) == (295936, 1024)
    assert model.image_token_id == tokenizer.token_to_id(IMAGE_TOKEN)
    with safe_open(str(DEMO / "model.safetensors"), "pt") as f:
        tower = [n for n in f.keys() if n.startswith(("vision.", "aligner.", "image_"))]  # noqa: SIM118
        stored = sum(f.get_tensor(n).nbytes for n in tower)
    assert {"image_start", "image_newline", "image_end", "aligner.w1.weight"} <= set(tower)
    assert "vision.patch_embed.proj.weight" in tower and stored <= MAX_TOWER_BYTES


@pytest.mark.parametrize("offset", range(3))
def test_greedy_reply_names_the_pictures_colour(demo, offset: int) -> None:
    config, model, tokenizer = demo
    vision = vision_config(config)
    assert vision is not None
    image, scene = render_scene(HELDOUT_SEED_BASE + offset)
    processed = process_image(png_bytes(image), vision)
    rows = model.encode_image(processed.patches, processed.plan)
    question, _ = colour_question(scene)
    prompt = prompt_ids(tokenizer, model.image_token_id, processed.tokens, question)
    reply = tokenizer.decode(greedy_answer(model, prompt, rows.detach()))
    assert first_word_of(reply, list(COLOURS)) == scene.colour, (question, reply)
