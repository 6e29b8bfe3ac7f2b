"""Held-out accuracy of the demo model's eyes: colour and shape questions on rendered pictures.

Each held-out picture (training/vision_data.py, seeds from ``HELDOUT_SEED_BASE``:
none the vision stage trained on) is asked "What colour is the <shape>?" and
"What shape is this?" in a one-turn chat, laid out as the server lays out an image
part (training/vision_chat.py); the greedy reply is right when the first colour
(shape) word it names is the picture's. Decoding runs the dense forward with the
image's rows at the span (training/vision_eval.py), under semantics 1 (``exact``)
and under the engine's default plan (``serving``: CED prefill, 32-token replay,
FP4 global KV, FP8 SWA).

    .venv/bin/python bench/vision_quality.py                  # 100 pictures, both plans
    .venv/bin/python bench/vision_quality.py --images 20 --plans exact

``--row-sensitivity`` measures instead how much the text model listens to an image
span at all: the answer loss of chats about pictures whose span rows are zeros, or
random rows at growing scales, through the frozen text model of ``--model`` (the
tower untrained). A text model that ignores the span scores them all alike, and
then no tower can steer it while it stays frozen.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

from engine.loader.checkpoint import load_checkpoint
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.vision.config import vision_config
from training.demo_config import demo_checkpoint_dir
from training.vision_eval import HELDOUT_SEED_BASE, score_pictures

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(demo_checkpoint_dir()))
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--plans", nargs="+", default=["exact", "serving"])
    parser.add_argument("--out", default=str(RESULTS / "vision_quality.json"))
    parser.add_argument("--row-sensitivity", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.row_sensitivity:
        return row_sensitivity(Path(args.model), args.images)

    config, model = load_checkpoint(args.model, quantization="none")
    vision = vision_config(config)
    if vision is None or not isinstance(model, DeepseekV41) or model.image_token_id is None:
        print(f"{args.model}: the model has no vision tower", file=sys.stderr)
        return 1
    tokenizer = load_tokenizer(args.model)
    seeds = range(HELDOUT_SEED_BASE, HELDOUT_SEED_BASE + args.images)
    rows: dict[str, dict[str, float | int]] = {}
    examples: list[dict[str, str]] = []
    for plan in args.plans:
        started = time.monotonic()
        shown = examples if plan == args.plans[0] else None
        score = score_pictures(model, tokenizer, vision, model.image_token_id, seeds, plan, shown)
        rows[plan] = score.to_dict() | {"seconds": round(time.monotonic() - started, 1)}
        print(
            f"{plan:8s} {score.images} pictures: colour {score.colour_accuracy:.1%} "
            f"({score.colour_correct}/{score.images}), shape {score.shape_accuracy:.1%} "
            f"({score.shape_correct}/{score.images})",
            flush=True,
        )
    for example in examples[:6]:
        print(f"  seed {example['seed']}: {example['question']} -> {example['reply']!r}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.date.today().isoformat(),
        "model": args.model,
        "seeds": [seeds.start, seeds.stop],
        "plans": rows,
        "examples": examples[:20],
    }
    out.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


@torch.no_grad()
def row_sensitivity(model_dir: Path, images: int) -> int:
    """Mean answer loss (nats a reply token) with zero and random span rows."""
    from engine.model.deepseek_v41.vision.image_processor import process_image
    from training.vision_chat import image_chat
    from training.vision_data import png_bytes, qa_turns, render_scene
    from training.vision_stage import DEMO_VISION, chat_loss, seeing_model

    _, model, tokenizer, _ = seeing_model(model_dir, DEMO_VISION, 0)
    assert model.image_token_id is not None
    scales = (0.0, 1.0, 10.0, 100.0)
    totals = dict.fromkeys(scales, 0.0)
    for seed in range(HELDOUT_SEED_BASE, HELDOUT_SEED_BASE + images):
        image, scene = render_scene(seed)
        processed = process_image(png_bytes(image), DEMO_VISION)
        turns = qa_turns(seed, scene, 1)
        chat = image_chat(tokenizer, model.image_token_id, processed.tokens, turns)
        for scale in scales:
            noise = torch.Generator().manual_seed(seed)
            rows = torch.randn(processed.tokens, model.config.hidden_size, generator=noise)
            totals[scale] += float(chat_loss(model, chat.ids, chat.targets, rows * scale))
    for scale in scales:
        print(f"span rows x {scale:5.1f}: answer loss {totals[scale] / images:.3f} nats/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
