"""The vision stage's checkpoint: the text tensors of the demo byte for byte (or, when
the stage trained the text model too, the trained values in their stored formats, the
drafter byte for byte), the tower under the release's names, a config and tokenizer
the loader serves images from.

The tower here is untrained (seeded): what is tested is the writing, not the seeing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.loader.checkpoint import load_checkpoint
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.vision.config import IMAGE_TOKEN, vision_config
from training.demo_config import demo_checkpoint_dir
from training.vision_stage import (
    DEMO_VISION,
    DRAFTER_PREFIX,
    VISION_PREFIXES,
    VisionTrainConfig,
    annealing_pass,
    seeing_model,
    write_seeing_checkpoint,
)
from training.weight_qat import served_value


def _stored(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118


def test_written_checkpoint_keeps_the_text_and_serves_the_tower(tmp_path: Path) -> None:
    demo = demo_checkpoint_dir()
    config, model, _, data = seeing_model(demo, DEMO_VISION, seed=0)
    with torch.no_grad():
        model.image_start.fill_(0.25)  # a value the loader must bring back
    write_seeing_checkpoint(demo, tmp_path, config, model, data, {"note": "test"})

    before, after = _stored(demo), _stored(tmp_path)
    text = {n for n in before if not n.startswith(VISION_PREFIXES)}
    assert text <= set(after)
    for name in text:  # byte for byte, quantised weights and scales alike
        assert after[name].dtype == before[name].dtype, name
        assert torch.equal(after[name].view(torch.uint8), before[name].view(torch.uint8)), name
    tower = set(after) - text
    assert "vision.blocks.1.attn.wqkv.weight" in tower and "aligner.w2.bias" in tower
    assert after["vision.blocks.0.attn.wqkv.weight"].dtype == torch.bfloat16
    assert after["image_start"].dtype == torch.float32

    loaded_config, loaded = load_checkpoint(tmp_path, quantization="none")
    assert vision_config(loaded_config) == DEMO_VISION
    tokenizer = load_tokenizer(tmp_path)
    assert loaded.image_token_id == tokenizer.token_to_id(IMAGE_TOKEN) == model.image_token_id
    assert torch.equal(loaded.image_start, torch.full_like(loaded.image_start, 0.25))
    record = json.loads((tmp_path / "training.json").read_text(encoding="utf-8"))
    assert record["vision_stage"] == {"note": "test"} and "stage_1" in record


def test_a_text_trained_checkpoint_stores_the_trained_text_and_keeps_the_drafter(
    tmp_path: Path,
) -> None:
    demo = demo_checkpoint_dir()
    config, model, _, data = seeing_model(demo, DEMO_VISION, seed=0)
    moved = ("layers.3.attn.wq_b.weight", "layers.5.ffn.experts.2.w1.weight", "embed.weight")
    params = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name in moved:  # as training would move them, off the stored grid
            params[name].add_(0.01 * torch.randn_like(params[name]))
        trained = {name: params[name].detach().clone() for name in moved}
    write_seeing_checkpoint(demo, tmp_path, config, model, data, {}, text_too=True)

    before, after = _stored(demo), _stored(tmp_path)
    # The same names (a tower added, or replaced when the demo already sees).
    tower = {n for n in after if n.startswith(VISION_PREFIXES)}
    assert tower and set(after) == {n for n in before if not n.startswith(VISION_PREFIXES)} | tower
    for name in (n for n in before if n.startswith(DRAFTER_PREFIX)):
        assert torch.equal(after[name].view(torch.uint8), before[name].view(torch.uint8)), name
    _, loaded = load_checkpoint(tmp_path, quantization="none")
    served = loaded.state_dict()
    for name in moved:  # what the format gives back for the trained value, not the old one
        assert torch.equal(served[name], served_value(name, trained[name])), name
        assert not torch.equal(after[name], before[name]), name


def test_the_annealing_pass_goes_on_at_half_rates_on_unseen_pictures(tmp_path: Path) -> None:
    first = VisionTrainConfig(probe_steps=900, steps=600, lr=3e-3, text_lr=3e-4)
    second = annealing_pass(first, minutes=20)
    assert (second.lr, second.text_lr) == (1.5e-3, 1.5e-4)
    assert second.resume and second.probe_steps == 0 and second.probe_weight == 0
    assert second.max_seconds == 1200
    # Align step k sees picture probe_steps + first_picture + k: the second pass's
    # pictures start after every picture the first pass could reach.
    seen = set(range(first.probe_steps + first.first_picture + first.steps))
    assert second.probe_steps + second.first_picture not in seen
    assert second.probe_steps + second.first_picture == max(seen) + 1
    assert annealing_pass(VisionTrainConfig(text_lr=None), 5).text_lr is None

    # Its record goes beside the first pass's, not over it.
    demo = demo_checkpoint_dir()
    config, model, _, data = seeing_model(demo, DEMO_VISION, seed=0)
    write_seeing_checkpoint(demo, tmp_path, config, model, data, {"pass": 1})
    write_seeing_checkpoint(
        tmp_path, tmp_path, config, model, data, {"pass": 2}, stage="vision_stage_resumed"
    )
    record = json.loads((tmp_path / "training.json").read_text(encoding="utf-8"))
    assert record["vision_stage"] == {"pass": 1} and record["vision_stage_resumed"] == {"pass": 2}
