"""The loader reads the drafter by the release's names, as stored, and refuses a
missing or misnamed drafter tensor by name; a checkpoint without one loads the text
model alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loader.checkpoint import load_checkpoint
from engine.loader.checkpoint_writer import make_tiny
from engine.loader.files import iter_checkpoint_tensors
from engine.loader.formats import CheckpointError, dequantize
from engine.model.deepseek_v41.fp8_linear import Fp8Linear
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.weights import WeightFormat


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=5)


def _rewritten(base: Path, out: Path, edit) -> Path:
    """A copy of the one-file checkpoint ``base`` with its tensors passed through ``edit``."""
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (base / name).exists():
            (out / name).write_text((base / name).read_text())
    tensors = load_file(base / "model.safetensors")
    save_file(edit(tensors), out / "model.safetensors")
    return out


def test_make_tiny_writes_the_drafter_as_the_release_stores_it(tiny: Path) -> None:
    stored = {t.name: t.dtype for t in iter_checkpoint_tensors(tiny)}
    assert stored["mtp.0.main_proj.weight"] == "F8_E4M3" and "mtp.0.main_proj.scale" in stored
    assert stored["mtp.0.attn.wq_a.weight"] == "F8_E4M3"
    assert stored["mtp.0.ffn.experts.3.w1.weight"] == "I8"  # MXFP4 pairs
    assert stored["mtp.0.ffn.shared_experts.w2.weight"] == "F8_E4M3"
    assert stored["mtp.0.markov_head.embed.weight"] == "BF16"
    assert stored["mtp.0.markov_head.head.weight"] == "F32"
    assert stored["mtp.0.confidence_head.proj.weight"] == "F32"
    assert stored["mtp.0.hc_attn_fn"] == "F32"


def test_load_by_release_names_as_stored(tiny: Path) -> None:
    config, model = load_checkpoint(tiny, quantization="none")
    assert isinstance(model, DeepseekV41) and model.dspark is not None
    # Every drafter tensor is the stored value: plain ones as they are, quantised ones
    # dequantised (the stored bytes are the oracle, not the loader's code path).
    got = model.state_dict()
    raw = load_file(tiny / "model.safetensors")
    for name in (
        "mtp.0.markov_head.head.weight",
        "mtp.0.confidence_head.proj.weight",
        "mtp.0.hc_ffn_fn",
        "mtp.0.ffn.gate.bias",
        "mtp.0.main_norm.weight",
    ):
        assert torch.equal(got[name], raw[name].float()), name
    assert torch.equal(
        got["mtp.0.markov_head.embed.weight"], raw["mtp.0.markov_head.embed.weight"].float()
    )
    for name in ("mtp.0.main_proj.weight", "mtp.0.attn.wo_b.weight"):
        scale = raw[name.removesuffix(".weight") + ".scale"]
        value = dequantize(WeightFormat.FP8_BLOCK, raw[name], scale, torch.float32)
        assert torch.equal(got[name], value), name
    # Packed ("auto"): the drafter's FP8 projections keep their stored bytes, and it runs.
    _, packed = load_checkpoint(tiny, quantization="auto")
    assert packed.dspark is not None
    assert isinstance(packed.dspark.stages[0].main_proj, Fp8Linear)
    g = torch.Generator().manual_seed(0)
    feats = {7: torch.randn(5, config.hc_mult, config.hidden_size, generator=g)}
    d = packed.dspark
    kv = d.context_kv(d.context(feats), torch.arange(5))
    assert d.draft(9, 5, kv, packed.embed, packed.head).tokens.shape == (config.dspark_block_size,)


def test_missing_and_misnamed_drafter_tensors_are_named(tiny: Path, tmp_path: Path) -> None:
    def drop(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: v for n, v in t.items() if n != "mtp.0.markov_head.head.weight"}

    with pytest.raises(CheckpointError, match=r"mtp\.0\.markov_head\.head\.weight.*missing"):
        load_checkpoint(_rewritten(tiny, tmp_path / "drop", drop))

    def rename(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t["mtp.0.markov_head.markov_w1.weight"] = t.pop("mtp.0.markov_head.embed.weight")
        return t

    with pytest.raises(CheckpointError, match=r"markov_w1\.weight.*unexpected"):
        load_checkpoint(_rewritten(tiny, tmp_path / "rename", rename))

    def stray_stage(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        t["mtp.1.norm.weight"] = torch.ones(t["mtp.0.norm.weight"].shape)  # one stage only
        return t

    with pytest.raises(CheckpointError, match=r"mtp\.1\.norm\.weight.*unexpected"):
        load_checkpoint(_rewritten(tiny, tmp_path / "stray", stray_stage))


def test_a_checkpoint_without_a_drafter_loads_the_text_model(tiny: Path, tmp_path: Path) -> None:
    def strip(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: v for n, v in t.items() if not n.startswith("mtp.")}

    out = _rewritten(tiny, tmp_path / "text", strip)
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["num_nextn_predict_layers"] == 1  # as the demo's
    _, model = load_checkpoint(out)
    assert model.dspark is None
