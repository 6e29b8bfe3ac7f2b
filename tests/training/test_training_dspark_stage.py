"""The DSpark stage's checkpoint, on top of the demo's: the text tensors byte for byte,
the drafter under the release's names, the config fields the loader builds it from,
and a drafter the engine speculates with without changing a greedy token.

Three prompts and two distillation steps, a drafter shape that is not the demo's
(so the fields are seen written, not kept): what is tested is the writing and the
serving, not the drafter's quality (docs/BENCHMARKS.md measures the demo's).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.loader.builder import engine_for_model
from engine.loader.checkpoint import load_checkpoint
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.dspark.drafter import DSparkDrafter
from training.corpus import Play
from training.demo_config import demo_checkpoint_dir
from training.dspark_distill import DistillConfig
from training.dspark_stage import DSparkShape, DSparkStageConfig, build_dspark_stage

PLAY = Play(
    "test",
    "A Test",
    "Ham.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind\n\n"
    "Hor.\nMy lord, I came to see your father's funeral.\n\n"
    "Ham.\nI pray thee, do not mock me, fellow-student;\nI think it was to see my mother's.\n",
)
SHAPE = DSparkShape(target_layer_ids=(6, 7), markov_rank=8)


def _stored(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}  # noqa: SIM118


CFG = DSparkStageConfig(
    train_prompts=2,
    heldout_prompts=1,
    new_tokens=5,
    distill=DistillConfig(steps=2, batch=2),
    shape=SHAPE,
)


def _build(out: Path) -> dict:
    base = demo_checkpoint_dir()
    return build_dspark_stage(base, out, base, CFG, plays=([PLAY], [PLAY]), say=lambda m: None)


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> tuple[Path, Path, dict]:
    out = tmp_path_factory.mktemp("staged")
    return demo_checkpoint_dir(), out, _build(out)


def test_the_stage_writes_the_drafter_beside_the_unchanged_text_model(staged) -> None:
    base, out, record = staged
    before, after = _stored(base), _stored(out)
    text = {n for n in before if not n.startswith("mtp.")}
    assert text == {n for n in after if not n.startswith("mtp.")}
    for name in text:  # byte for byte, quantised weights and scales alike
        assert torch.equal(after[name].view(torch.uint8), before[name].view(torch.uint8)), name
    # The release's names and formats: an FP8 linear with its scale, norms in FP32.
    assert after["mtp.0.main_proj.weight"].dtype == torch.float8_e4m3fn
    assert after["mtp.0.main_proj.scale"].dtype == torch.float8_e8m0fnu
    assert after["mtp.0.main_proj.weight"].shape == (256, 2 * 256)
    assert after["mtp.0.norm.weight"].dtype == torch.float32
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))["text_config"]
    assert config["dspark_target_layer_ids"] == [6, 7]
    assert config["dspark_markov_rank"] == 8 and config["num_nextn_predict_layers"] == 1
    training = json.loads((out / "training.json").read_text(encoding="utf-8"))
    assert "stage_1" in training and training["dspark_stage"]["steps"] == 2
    assert (
        training["dspark_stage"]["heldout_mean_acceptance_length"]
        == (record["heldout_mean_acceptance_length"])
    )
    assert 1.0 <= record["heldout_mean_acceptance_length"] <= 1.0 + record["k"]


def test_the_written_drafter_loads_and_keeps_greedy_output(staged) -> None:
    _, out, _ = staged
    config, model = load_checkpoint(out, dtype=torch.float64, quantization="none")
    model = model.double().eval()
    assert isinstance(model.dspark, DSparkDrafter)
    assert model.dspark.target_layer_ids == (6, 7)
    assert config.dspark_markov_rank == 8
    # The trained values came back (not zeros): the Markov head was zero at the warm start.
    head = model.dspark.stages[-1].markov_head
    assert head is not None and head.head.weight.abs().sum() > 0
    tokenizer = load_tokenizer(out)
    prompts = {"a": tokenizer.encode("To be, or not").ids, "b": list(range(40, 61))}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    streams = []
    for spec in (None, json.dumps({"method": "dspark", "num_speculative_tokens": 4})):
        ec = EngineConfig(
            max_num_seqs=2, kv_cache_bytes=64 << 20, dtype="float64", speculative_config=spec
        )
        engine = engine_for_model(ec, model, tokenizer=tokenizer)
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        for rid, ids in prompts.items():
            engine.add_request(Request(rid, ids, params))
        while engine.has_unfinished_requests():
            for step in engine.step():
                tokens[step.request_id] += [t for c in step.outputs for t in c.token_ids]
        counters = engine.stats().counters
        engine.close()
        streams.append((tokens, counters.spec_drafts))
    (plain, plain_drafts), (fast, drafts) = streams
    assert fast == plain and all(len(t) == 8 for t in plain.values())
    assert plain_drafts == 0 and drafts > 0


def test_a_second_run_writes_the_same_drafter(staged, tmp_path: Path) -> None:
    _, out, _ = staged
    _build(tmp_path)  # seeded: rollouts, draws and steps repeat
    first, second = _stored(out), _stored(tmp_path)
    drafter = [n for n in first if n.startswith("mtp.")]
    assert drafter and set(drafter) == {n for n in second if n.startswith("mtp.")}
    for name in drafter:
        assert torch.equal(first[name].view(torch.uint8), second[name].view(torch.uint8)), name
