"""Greedy answers of a model that sees, through the dense forward; accuracy on pictures.

``greedy_answer`` decodes as ``reference_generate`` does (a dense forward per
step, the admission plan fixed), with the image's rows replacing the span's
embeddings at every step. ``plan="exact"`` is semantics 1 (training's forward);
``plan="serving"`` is the engine's default (CED prefill with a 32-token replay,
FP4 global KV, FP8 SWA), so both the oracle and what ``make serve`` computes
are measured.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from tokenizers import Tokenizer

from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.vision.config import VisionConfig
from engine.model.deepseek_v41.vision.image_processor import ProcessedImage, process_image
from engine.model.kv.dense_backend import DenseKV, KVPrecision
from engine.model.semantics.replay import ReplayPlan
from training.bpe import EOS_ID
from training.vision_chat import prompt_ids
from training.vision_data import (
    COLOURS,
    SHAPES,
    colour_question,
    png_bytes,
    render_scene,
    shape_question,
)

EXACT_KV = KVPrecision(global_kv="exact", swa="exact")
# Held-out pictures: seeds the training stream never reaches.
HELDOUT_SEED_BASE = 1_000_000
MAX_ANSWER_TOKENS = 10
EXAMPLES_IN_FULL = 8

Plan = Literal["exact", "serving"]


def image_rows(model: DeepseekV41, image: ProcessedImage) -> torch.Tensor:
    return model.encode_image(image.patches, image.plan)


@torch.no_grad()
def greedy_answer(
    model: DeepseekV41,
    prompt: torch.Tensor,
    rows: torch.Tensor,
    plan: Plan = "exact",
    max_new_tokens: int = MAX_ANSWER_TOKENS,
    until: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Greedy ids after ``prompt`` (its image positions fed ``rows``), up to EOS, or
    until ``until(ids so far)`` holds (the evaluation stops once the answer is named)."""
    config = model.config
    if plan == "exact":
        replay, precision = ReplayPlan.exact(config), EXACT_KV
    else:
        replay = ReplayPlan.prefill(config, len(prompt), config.sliding_window, ced=True)
        precision = KVPrecision()
    tokens = prompt.tolist()
    out: list[int] = []
    for _ in range(max_new_tokens):
        ids = torch.tensor(tokens)
        kv = DenseKV(config, ids, replay, None, precision, model.embed.weight.dtype)
        logits = model(ids[replay.encoder_start :], kv, image_embeds=rows)
        nxt = int(torch.argmax(logits[-1]))
        if nxt == EOS_ID:
            break
        out.append(nxt)
        tokens.append(nxt)
        if until is not None and until(out):
            break
    return out


def first_word_of(text: str, words: tuple[str, ...] | list[str]) -> str | None:
    """The first of ``words`` the text names (whole words, any case), or None."""
    found = re.findall(r"[a-z]+", text.lower())
    return next((w for w in found if w in words), None)


def names_one_of(
    tokenizer: Tokenizer, words: tuple[str, ...] | list[str]
) -> Callable[[list[int]], bool]:
    """True once the decoded ids name one of ``words`` as a finished word (a non-letter
    after it), so that what the reply names first cannot change with more tokens."""

    def done(ids: list[int]) -> bool:
        text = tokenizer.decode(ids).lower()
        finished = re.findall(r"[a-z]+(?=[^a-z])", text)
        return any(w in words for w in finished)

    return done


@dataclass(slots=True)
class VisionScore:
    colour_correct: int = 0
    shape_correct: int = 0
    images: int = 0

    @property
    def colour_accuracy(self) -> float:
        return self.colour_correct / max(self.images, 1)

    @property
    def shape_accuracy(self) -> float:
        return self.shape_correct / max(self.images, 1)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "images": self.images,
            "colour_accuracy": round(self.colour_accuracy, 4),
            "shape_accuracy": round(self.shape_accuracy, 4),
        }


def score_pictures(
    model: DeepseekV41,
    tokenizer: Tokenizer,
    vision: VisionConfig,
    image_token_id: int,
    seeds: range,
    plan: Plan = "exact",
    examples: list[dict[str, str]] | None = None,
) -> VisionScore:
    """Ask each picture its colour question and its shape question; count right answers
    (the first colour or shape word the reply names must be the picture's)."""
    score = VisionScore()
    model.eval()
    for seed in seeds:
        image, scene = render_scene(seed)
        processed = process_image(png_bytes(image), vision)
        with torch.no_grad():
            rows = image_rows(model, processed)
        for ask, words, truth in (
            (colour_question, list(COLOURS), scene.colour),
            (shape_question, SHAPES, scene.shape),
        ):
            question, _ = ask(scene)
            prompt = prompt_ids(tokenizer, image_token_id, processed.tokens, question)
            # Whole replies for the first few examples shown; the rest stop once named.
            shown = examples is not None and len(examples) < EXAMPLES_IN_FULL
            until = None if shown else names_one_of(tokenizer, words)
            reply = tokenizer.decode(greedy_answer(model, prompt, rows, plan, until=until))
            right = first_word_of(reply, words) == truth
            if words is SHAPES:
                score.shape_correct += right
            else:
                score.colour_correct += right
            if examples is not None:
                examples.append({"seed": str(seed), "question": question, "reply": reply})
        score.images += 1
    return score
