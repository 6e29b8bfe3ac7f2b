"""The vision stage's data: pictures drawn from a seed alone, chats laid out as the
server lays out an image part (server/chat/chat_encoding.py with the parts joined by
a blank line is the oracle), and the placeholder token that leaves text untouched."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from engine.model.deepseek_v41.vision.config import IMAGE_TOKEN
from engine.model.deepseek_v41.vision.image_processor import process_image
from server.chat.chat_encoding import EOS, encode_chat
from server.chat.tool_calls import THINK_END
from server.openai.protocol import ChatCompletionRequest
from training.demo_config import demo_checkpoint_dir
from training.image_token import NEVER_ENCODED_BYTE, with_image_token
from training.vision_chat import image_chat, prompt_ids
from training.vision_data import (
    BACKGROUNDS,
    COLOURS,
    FILL_JITTER,
    SIZE,
    png_bytes,
    qa_turns,
    render_scene,
    scene_of,
)
from training.vision_stage import DEMO_VISION

TEXT_SAMPLES = [
    "To be, or not to be, that is the question:",
    'What colour is the circle?\n\n{"shape": "star"}',
    "Ünïcödé ÿ façade — naïve 日本語 🙂 <｜User｜> tab\there",
]


@pytest.fixture(scope="module")
def tokenizers() -> tuple[Tokenizer, Tokenizer, int]:
    raw = json.loads((demo_checkpoint_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    if any(t["content"] == IMAGE_TOKEN for t in raw["added_tokens"]):
        # The committed demo already has it: rebuild the text-only tokenizer to compare.
        entry = next(t for t in raw["added_tokens"] if t["content"] == IMAGE_TOKEN)
        raw["added_tokens"].remove(entry)
        raw["model"]["vocab"][NEVER_ENCODED_BYTE] = raw["model"]["vocab"].pop(IMAGE_TOKEN)
    seeing, image_id = with_image_token(raw)
    return Tokenizer.from_str(json.dumps(raw)), Tokenizer.from_str(json.dumps(seeing)), image_id


def test_rendering_is_a_function_of_the_seed() -> None:
    a, scene_a = render_scene(7)
    b, scene_b = render_scene(7)
    assert a.tobytes() == b.tobytes() and scene_a == scene_b
    assert png_bytes(a) == png_bytes(b)
    assert render_scene(8)[0].tobytes() != a.tobytes()
    assert qa_turns(7, scene_a, 3) == qa_turns(7, scene_b, 3)


@pytest.mark.parametrize("seed", range(12))
def test_the_picture_shows_its_scene(seed: int) -> None:
    """The centre pixel is the named colour (within the jitter) and a corner, which no
    shape reaches, is the named background's gray."""
    image, scene = render_scene(seed)
    assert image.size == (SIZE, SIZE)
    centre = image.getpixel((round(scene.centre[0]), round(scene.centre[1])))
    assert all(
        abs(c - t) <= FILL_JITTER for c, t in zip(centre, COLOURS[scene.colour], strict=True)
    )
    corner = image.getpixel((0, 0))
    low, high = BACKGROUNDS[scene.background]
    assert corner[0] == corner[1] == corner[2] and low <= corner[0] <= high


def test_the_picture_is_the_release_processors_smallest_unscaled_size() -> None:
    image = process_image(png_bytes(render_scene(0)[0]), DEMO_VISION)
    assert (image.plan.box_width, image.plan.box_height) == (546, 546)  # 544 rounded up to 14s
    assert image.tokens == 13 * 14 + 2 and image.patches.shape == (39 * 39, 588)


def test_the_placeholder_leaves_text_as_it_was(tokenizers) -> None:
    text, seeing, image_id = tokenizers
    assert image_id == text.token_to_id(NEVER_ENCODED_BYTE)
    assert seeing.get_vocab_size() == text.get_vocab_size()
    for sample in TEXT_SAMPLES:
        assert seeing.encode(sample).ids == text.encode(sample).ids
        assert image_id not in text.encode(sample).ids
    assert seeing.encode("a" + IMAGE_TOKEN + "b").ids == [
        *text.encode("a").ids,
        image_id,
        *text.encode("b").ids,
    ]
    assert seeing.decode([image_id]) == IMAGE_TOKEN
    # Idempotent: a second call finds the token.
    data = json.loads(seeing.to_str())
    assert with_image_token(data)[1] == image_id


def _server_ids(tokenizer: Tokenizer, turns, thinking: bool, image_tokens: int, image_id: int):
    """Oracle: the server's chat encoding of the turns, the image part a text part holding
    one placeholder (parts joined by a blank line), that one id then widened to the span."""
    messages = []
    for i, (question, answer) in enumerate(turns):
        content = (
            [{"type": "text", "text": IMAGE_TOKEN}, {"type": "text", "text": question}]
            if i == 0 and image_tokens
            else question
        )
        messages.append({"role": "user", "content": content})
        if i < len(turns) - 1:
            messages.append({"role": "assistant", "content": answer})
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    prompt = encode_chat(request.messages, thinking=thinking, reasoning_effort=75)
    text = prompt + (THINK_END if thinking else "") + turns[-1][1] + EOS
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not image_tokens:
        return ids
    at = ids.index(image_id)
    return ids[:at] + [image_id] * image_tokens + ids[at + 1 :]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("n_turns", [1, 3])
def test_chat_is_the_server_layout_of_an_image_part(tokenizers, thinking, n_turns) -> None:
    _, seeing, image_id = tokenizers
    _, scene = render_scene(3)
    turns = qa_turns(3, scene, n_turns)
    chat = image_chat(seeing, image_id, 184, turns, thinking=thinking)
    assert chat.ids.tolist() == _server_ids(seeing, turns, thinking, 184, image_id)
    assert int((chat.ids == image_id).sum()) == 184
    # The loss's targets are the replies and their EOS, nothing else.
    replies = [seeing.encode(a + EOS, add_special_tokens=False).ids for _, a in turns]
    assert chat.ids[chat.targets].tolist() == [t for r in replies for t in r]


@pytest.mark.parametrize("thinking", [False, True])
def test_a_chat_without_a_picture_is_the_server_layout_of_text(tokenizers, thinking) -> None:
    # The vision stage's negatives: the same questions with no picture.
    _, seeing, image_id = tokenizers
    _, scene = render_scene(5)
    turns = qa_turns(5, scene, 3)
    chat = image_chat(seeing, image_id, 0, turns, thinking=thinking)
    assert chat.ids.tolist() == _server_ids(seeing, turns, thinking, 0, image_id)
    assert image_id not in chat.ids.tolist()


def test_prompt_ends_at_the_assistants_opening(tokenizers) -> None:
    _, seeing, image_id = tokenizers
    prompt = prompt_ids(seeing, image_id, 184, "What shape is this?")
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": IMAGE_TOKEN},
                        {"type": "text", "text": "What shape is this?"},
                    ],
                }
            ],
        }
    )
    ids = seeing.encode(
        encode_chat(request.messages, thinking=False, reasoning_effort=75),
        add_special_tokens=False,
    ).ids
    at = ids.index(image_id)
    assert prompt.tolist() == ids[:at] + [image_id] * 184 + ids[at + 1 :]
    assert prompt.dtype == torch.long


def test_scenes_cover_every_class() -> None:
    scenes = [scene_of(s) for s in range(200)]
    assert {s.shape for s in scenes} == {"circle", "square", "triangle", "star"}
    assert {s.colour for s in scenes} == set(COLOURS)
    assert {s.background for s in scenes} == set(BACKGROUNDS)
