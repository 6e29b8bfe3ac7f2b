"""Checkpoint save/load in the official layout, and the tiny checkpoint.

Oracles: the in-memory model with every tensor round-tripped through the
writer's encoding and the kernels' dequantisation (a second path that bypasses
files, shards, headers and name matching), hand-written stored shapes, and the
``tokenizers`` library for the tokenizer.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from engine.loader.checkpoint import load_checkpoint
from engine.loader.checkpoint_writer import (
    encode_tensor,
    make_tiny,
    save_checkpoint,
    tiny_checkpoint_config,
)
from engine.loader.files import INDEX_FILE, SINGLE_FILE, iter_checkpoint_tensors, weight_map
from engine.loader.formats import CheckpointError, dequantize, stored_shapes
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.engram import build_compressed_vocab
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.weight_names import WEIGHTS
from engine.model.weights import SCALE_SUFFIX, WeightFormat, scale_name

SEED = 3
IDS = torch.tensor([0, 5, 17, 99, 1234, 2, 64000, 7, 7, 128803, 31, 8])


# What make-tiny writes: the tiny text model and a small vision tower.
TINY = tiny_checkpoint_config()


def _tiny_model(seed: int = SEED) -> DeepseekV41:
    model = DeepseekV41(TINY)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def _round_tripped(model: DeepseekV41) -> DeepseekV41:
    """The in-memory model after each tensor's encode -> dequantise, without files."""
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            stored = encode_tensor(name, tensor, WEIGHTS)
            fmt = WEIGHTS.format_of(name)
            scale = stored.get(scale_name(name))
            plain = scale is None
            value = dequantize(None if plain else fmt, stored[name], scale, torch.float32)
            tensor.copy_(value.to(tensor.dtype))
    return model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=SEED)


@pytest.fixture(scope="module")
def original() -> DeepseekV41:
    """The seeded tiny model before any quantisation (do not modify)."""
    return _tiny_model()


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory, original: DeepseekV41) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    # ~20 MB shards: embed and head (66 MB each in BF16) get their own shards.
    return save_checkpoint(original, TINY, out, shard_bytes=20_000_000)


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path) -> DeepseekV41:
    # Dequantised at load: the round trip through the writer's formats (the packed
    # default: tests/engine/loader/test_checkpoint_experts.py, test_packed_linears.py).
    config, model = load_checkpoint(tiny_dir, quantization="none")
    assert config.to_dict() == TINY.to_dict()
    return model


@pytest.fixture(scope="module")
def oracle(tiny_dir: Path, original: DeepseekV41) -> DeepseekV41:
    model = _round_tripped(copy.deepcopy(original))
    class_of, _ = build_compressed_vocab(load_tokenizer(tiny_dir / "tokenizer.json"))
    model.set_compressed_vocab(class_of)
    return model


# ------------------------------------------------------------- the format table


def test_every_tiny_tensor_has_a_format() -> None:
    with torch.device("meta"):
        names = DeepseekV41(TINY).state_dict().keys()
    assert [n for n in names if WEIGHTS.format_of(n) is None] == []


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("layers.3.ffn.experts.5.w2.weight", WeightFormat.MXFP4),
        ("layers.1.engram.embed.weight", WeightFormat.FP8_ROWS),
        ("layers.0.attn.wq_a.weight", WeightFormat.FP8_BLOCK),
        ("layers.4.attn.wkv.weight", WeightFormat.FP8_BLOCK),
        ("layers.6.attn.indexer.wq_b.weight", WeightFormat.FP8_BLOCK),
        ("layers.2.ffn.shared_experts.w3.weight", WeightFormat.FP8_BLOCK),
        ("layers.4.attn.compressor.wkv.weight", WeightFormat.BF16),
        ("layers.2.attn.compressor.wgate.weight", WeightFormat.BF16),
        ("layers.2.attn.indexer.wk.weight", WeightFormat.BF16),
        ("layers.6.attn.indexer.weights_proj.weight", WeightFormat.BF16),
        ("layers.0.ffn.gate.weight", WeightFormat.BF16),
        ("layers.0.ffn.gate.bias", WeightFormat.FP32),
        ("layers.2.attn.compressor.norm.weight", WeightFormat.FP32),
        ("layers.2.attn.indexer.k_norm.weight", WeightFormat.FP32),
        ("layers.7.attn.q_norm.weight", WeightFormat.FP32),
        ("layers.7.ffn_norm.weight", WeightFormat.FP32),
        ("layers.7.hc_ffn_fn", WeightFormat.FP32),
        ("layers.7.attn.attn_sink", WeightFormat.FP32),
        ("embed.weight", WeightFormat.BF16),
        ("head.weight", WeightFormat.BF16),
        ("norm.weight", WeightFormat.FP32),
        ("layers.0.attn.bogus", None),
    ],
)
def test_weight_format_table(name: str, fmt: WeightFormat | None) -> None:
    assert WEIGHTS.format_of(name) is fmt


def test_stored_shapes_by_hand() -> None:
    assert stored_shapes(WeightFormat.FP8_BLOCK, (8192, 4096)) == ((8192, 4096), (256, 128))
    assert stored_shapes(WeightFormat.FP8_BLOCK, (40, 70)) == ((40, 70), (2, 3))
    assert stored_shapes(WeightFormat.MXFP4, (2304, 5120)) == ((2304, 2560), (2304, 160))
    assert stored_shapes(WeightFormat.FP8_ROWS, (1000, 256)) == ((1000, 256), (1000, 8))
    assert stored_shapes(WeightFormat.BF16, (7, 3)) == ((7, 3), None)


def test_tiny_checkpoint_stores_official_dtypes(tiny_dir: Path) -> None:
    stored = {t.name: t for t in iter_checkpoint_tensors(tiny_dir)}
    expert = stored["layers.3.ffn.experts.1.w1.weight"]
    assert (expert.dtype, expert.shape) == ("I8", (128, 128))
    assert stored["layers.3.ffn.experts.1.w1.scale"].dtype == "F8_E8M0"
    assert stored["layers.3.ffn.experts.1.w1.scale"].shape == (128, 8)
    assert stored["layers.0.attn.wq_b.weight"].dtype == "F8_E4M3"
    assert stored["layers.0.attn.wq_b.scale"].shape == (8 * 512 // 32, 64 // 32)
    assert stored["embed.weight"].dtype == "BF16"
    assert stored["layers.0.hc_attn_fn"].dtype == "F32"
    assert stored["layers.1.engram.embed.weight"].dtype == "F8_E4M3"
    assert not (tiny_dir / INDEX_FILE).exists()


# ------------------------------------------------------------- round trips


def test_loaded_tensors_equal_the_round_tripped_model(
    loaded: DeepseekV41, oracle: DeepseekV41
) -> None:
    want = oracle.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


def test_quantisation_is_real_but_close(original: DeepseekV41, oracle: DeepseekV41) -> None:
    for name in ("layers.3.ffn.experts.1.w1.weight", "layers.0.attn.wq_b.weight", "embed.weight"):
        a, b = original.state_dict()[name], oracle.state_dict()[name]
        assert not torch.equal(a, b), name
        # FP4 keeps ~1 significant bit per element, FP8 / BF16 far more.
        bound = 0.35 if "experts" in name else 0.07
        assert (a - b).norm() / a.norm() < bound, name


def test_loaded_logits_equal_the_round_tripped_model(
    loaded: DeepseekV41, oracle: DeepseekV41
) -> None:
    with torch.no_grad():
        got, want = loaded(IDS), oracle(IDS)
    assert got.shape == (len(IDS), ModelConfig.tiny().vocab_size)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


def test_loader_sets_the_engram_classes_of_the_checkpoint_tokenizer(loaded: DeepseekV41) -> None:
    classes = loaded.engram_vocab_map
    assert int(classes.max()) + 1 == ModelConfig.tiny().engram_compressed_vocab_size
    # "Hello" (19923), "hello" (33310) and " hello" (44388) fold to one class
    # (lowercase, strip); the two new chat tokens get classes of their own.
    assert int(classes[19923]) == int(classes[33310]) == int(classes[44388])
    assert len({int(classes[i]) for i in (33310, 128000, 128001)}) == 3


def test_sharded_round_trip(sharded_dir: Path, loaded: DeepseekV41) -> None:
    index = json.loads((sharded_dir / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert len(files) >= 3
    assert not (sharded_dir / SINGLE_FILE).exists()
    assert index["metadata"]["total_size"] == sum(
        (sharded_dir / f).stat().st_size for f in files
    ) - sum(_header_bytes(sharded_dir / f) for f in files)
    # Every weight sits in the same shard as its scale.
    for name, file in index["weight_map"].items():
        if name.endswith(SCALE_SUFFIX):
            assert index["weight_map"][name[: -len(SCALE_SUFFIX)] + ".weight"] == file
    _, model = load_checkpoint(sharded_dir, quantization="none")
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def _header_bytes(file: Path) -> int:
    with open(file, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_load_in_bfloat16_keeps_fp32_parameters(tiny_dir: Path, loaded: DeepseekV41) -> None:
    _, model = load_checkpoint(tiny_dir, dtype=torch.bfloat16, quantization="none")
    state = model.state_dict()
    assert state["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert state["layers.0.hc_attn_fn"].dtype == torch.float32  # declared fp32 by the model
    ref = loaded.state_dict()["layers.0.attn.wq_a.weight"]
    assert torch.equal(state["layers.0.attn.wq_a.weight"], ref.to(torch.bfloat16))


# ------------------------------------------------------------- error cases


def _tampered(
    base: Path,
    out: Path,
    *,
    drop: tuple[str, ...] = (),
    add: dict[str, torch.Tensor] | None = None,
) -> Path:
    """A copy of the sharded checkpoint (shards symlinked) with names dropped or added.

    Added tensors replace same-named ones: they go to an extra shard the index points to.
    """
    out.mkdir()
    index = json.loads((base / INDEX_FILE).read_text())
    for file in set(index["weight_map"].values()):
        (out / file).symlink_to(base / file)
    (out / "config.json").write_text((base / "config.json").read_text())
    for name in drop:
        del index["weight_map"][name]
    if add:
        save_file(add, out / "extra.safetensors")
        index["weight_map"].update(dict.fromkeys(add, "extra.safetensors"))
    (out / INDEX_FILE).write_text(json.dumps(index))
    return out


def test_missing_tensor_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    bad = _tampered(sharded_dir, tmp_path / "bad", drop=("layers.5.attn.wo_b.weight",))
    with pytest.raises(CheckpointError, match=r"layers\.5\.attn\.wo_b\.weight.*missing") as err:
        load_checkpoint(bad)
    assert err.value.tensor == "layers.5.attn.wo_b.weight"


def test_missing_scale_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    bad = _tampered(sharded_dir, tmp_path / "bad", drop=("layers.5.attn.wo_b.scale",))
    with pytest.raises(CheckpointError, match=r"layers\.5\.attn\.wo_b\.scale.*missing"):
        load_checkpoint(bad)


def test_unexpected_tensor_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    extra = {"layers.0.attn.bogus.weight": torch.zeros(4, 4)}
    bad = _tampered(sharded_dir, tmp_path / "bad", add=extra)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.bogus\.weight.*unexpected"):
        load_checkpoint(bad)


def test_wrong_shape_names_tensor_and_shapes(sharded_dir: Path, tmp_path: Path) -> None:
    bad = _tampered(sharded_dir, tmp_path / "bad", add={"norm.weight": torch.ones(257)})
    with pytest.raises(CheckpointError, match=r"`norm\.weight`.*\[257\].*expected \[256\]"):
        load_checkpoint(bad)


def test_wrong_packed_shape_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    # An MXFP4 expert stored unpacked ([128, 256] bytes instead of [128, 128]).
    name = "layers.2.ffn.experts.0.w1.weight"
    bad = _tampered(
        sharded_dir, tmp_path / "bad", add={name: torch.zeros(128, 256, dtype=torch.int8)}
    )
    with pytest.raises(
        CheckpointError, match=r"experts\.0\.w1\.weight.*\[128, 256\].*\[128, 128\]"
    ):
        load_checkpoint(bad)


def test_wrong_scale_shape_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    name = "layers.0.attn.wq_a.scale"
    scale = torch.ones(3, 8).to(torch.float8_e8m0fnu)
    bad = _tampered(sharded_dir, tmp_path / "bad", add={name: scale})
    with pytest.raises(CheckpointError, match=r"wq_a\.scale.*\[3, 8\].*expected \[2, 8\]"):
        load_checkpoint(bad)


@pytest.fixture(scope="module")
def text_only_dir(tmp_path_factory: pytest.TempPathFactory, original: DeepseekV41) -> Path:
    """The sharded checkpoint of the same text weights and no vision tower."""
    text = DeepseekV41(ModelConfig.tiny())
    unused = text.load_state_dict(original.state_dict(), strict=False).unexpected_keys
    assert unused and all(WEIGHTS.is_vision(n) for n in unused)
    out = tmp_path_factory.mktemp("text_only")
    return save_checkpoint(text, ModelConfig.tiny(), out, shard_bytes=20_000_000)


def test_skips_vision_and_accepts_plain_exports(
    text_only_dir: Path, tmp_path: Path, loaded: DeepseekV41, caplog: pytest.LogCaptureFixture
) -> None:
    # A dequantised re-export (no .scale) is accepted for a quantised tensor;
    # vision tensors for a model without a tower are skipped with one notice.
    name = "layers.0.attn.wq_a.weight"
    value = loaded.state_dict()[name].clone() * 3
    extra = {
        name: value,
        "vision.blocks.0.attn.qkv.weight": torch.zeros(2, 2),
    }
    drop = ("layers.0.attn.wq_a.scale",)
    ok = _tampered(text_only_dir, tmp_path / "ok", drop=drop, add=extra)
    with caplog.at_level(logging.INFO, logger="engine.loader.checkpoint"):
        _, model = load_checkpoint(ok, quantization="none")
    notices = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(notices) == 1 and "1 vision" in notices[0]
    assert model.vision is None
    assert torch.equal(model.state_dict()[name], value)
    assert torch.equal(model.state_dict()["head.weight"], loaded.state_dict()["head.weight"])


def test_a_vision_model_reads_its_tensors_and_refuses_strangers(
    sharded_dir: Path, tmp_path: Path
) -> None:
    """With a tower, vision names are model tensors: one the tower lacks is unexpected,
    one it needs is missing (never skipped)."""
    stray = {"vision.blocks.0.attn.qkv.weight": torch.zeros(2, 2)}
    bad = _tampered(sharded_dir, tmp_path / "stray", add=stray)
    with pytest.raises(CheckpointError, match=r"vision\.blocks\.0\.attn\.qkv.*unexpected"):
        load_checkpoint(bad)
    gone = _tampered(sharded_dir, tmp_path / "gone", drop=("aligner.w1.weight",))
    with pytest.raises(CheckpointError, match=r"aligner\.w1\.weight.*missing"):
        load_checkpoint(gone)


def test_make_tiny_holds_every_kind_and_the_loader_names_what_it_skips(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The release's index holds DSpark, vision and ``gate.bias_vl`` tensors besides the
    text model's: make-tiny writes each; the tower and the drafter load, nothing is skipped."""
    names = set(weight_map(tiny_dir))
    assert any(n.startswith("mtp.") for n in names)
    assert {"image_start", "image_newline", "image_end", "aligner.w1.weight"} <= names
    assert "vision.blocks.1.attn.wqkv.bias" in names
    assert "layers.0.ffn.gate.bias_vl" in names
    with caplog.at_level(logging.INFO, logger="engine.loader.checkpoint"):
        _, model = load_checkpoint(tiny_dir)
    notices = sorted(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    assert notices == []
    assert model.vision is not None and model.dspark is not None
    stored = {t.name: t for t in iter_checkpoint_tensors(tiny_dir)}
    assert stored["vision.blocks.0.norm1.weight"].dtype == "F32"
    assert stored["vision.blocks.0.attn.wqkv.weight"].dtype == "BF16"
    assert stored["image_start"].dtype == "F32"
    files = weight_map(tiny_dir)
    for name in ("image_start", "vision.patch_embed.proj.weight", "aligner.w2.bias"):
        with safe_open(files[name], framework="pt") as f:
            assert torch.equal(model.state_dict()[name], f.get_tensor(name).float()), name


def test_gate_bias_vl_is_loaded_and_may_be_absent(
    sharded_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``ffn.gate.bias_vl`` loads as stored (fp32); an export without it loads zeros."""
    config = ModelConfig.tiny()
    name = "layers.3.ffn.gate.bias_vl"
    value = torch.linspace(-1.0, 1.0, config.n_routed_experts)
    _, model = load_checkpoint(_tampered(sharded_dir, tmp_path / "vl", add={name: value}))
    assert torch.equal(model.state_dict()[name], value)
    every = tuple(f"layers.{l}.ffn.gate.bias_vl" for l in range(config.num_hidden_layers))
    with caplog.at_level(logging.INFO, logger="engine.loader.checkpoint"):
        _, model = load_checkpoint(_tampered(sharded_dir, tmp_path / "none", drop=every))
    assert all(bool((model.state_dict()[n] == 0).all()) for n in every)
    assert any("8 optional tensors absent" in r.getMessage() for r in caplog.records)


def test_encoder_only_load_reads_no_decoder_layer(
    tiny_dir: Path, loaded: DeepseekV41, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill worker's model: layers [0, B] and the rest of the model, as loaded in full."""
    with caplog.at_level(logging.INFO, logger="engine.loader.checkpoint"):
        _, model = load_checkpoint(tiny_dir, encoder_only=True, quantization="none")
    boundary = model.config.ced_boundary
    assert model.encoder_only and not loaded.encoder_only
    assert len(model.layers) == boundary + 1 < len(loaded.layers)
    full = loaded.state_dict()
    kept = model.state_dict()
    assert set(kept) == {n for n in full if not _past(n, boundary)}
    for name, value in kept.items():
        assert torch.equal(value, full[name]), name
    decoder = sum(1 for n in full if _past(n, boundary))
    scales = sum(
        1
        for n in full
        if _past(n, boundary) and WEIGHTS.format_of(n) and WEIGHTS.format_of(n).quantised
    )
    assert any(f"{decoder + scales} decoder-layer" in r.getMessage() for r in caplog.records)
    dropped = sum(p.numel() for layer in loaded.layers[boundary + 1 :] for p in layer.parameters())
    assert dropped > 0
    total = sum(p.numel() for p in loaded.parameters())
    assert sum(p.numel() for p in model.parameters()) == total - dropped


def _past(name: str, boundary: int) -> bool:
    return name.startswith("layers.") and int(name.split(".")[1]) > boundary


# ------------------------------------------------------------- tokenizer


def test_tiny_tokenizer_has_the_v41_chat_tokens(tiny_dir: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 129280
    assert tok.encode("<｜System｜>", add_special_tokens=False).ids == [128000]
    assert tok.encode("<｜deepseek_image｜>", add_special_tokens=False).ids == [128001]
    assert tok.id_to_token(128000) == "<｜System｜>"
    assert tok.id_to_token(128002) == "<｜place▁holder▁no▁2｜>"
    text = "<｜begin▁of▁sentence｜><｜System｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids[:2] == [0, 128000]
    assert 128803 in ids
    assert ids[-2:] == [128804, 128822]
    assert tok.decode([128000], skip_special_tokens=False) == "<｜System｜>"
    # The renamed placeholders are gone; the other chat tokens keep their ids.
    assert tok.token_to_id("<｜place▁holder▁no▁0｜>") is None
    assert tok.token_to_id("<｜User｜>") == 128803
    assert tok.token_to_id("<think>") == 128821
    raw = json.loads((tiny_dir / "tokenizer.json").read_text())
    contents = [t["content"] for t in raw["added_tokens"]]
    assert contents.count("<｜System｜>") == 1
    assert "<｜System｜>" not in raw["model"]["vocab"]
    assert (tiny_dir / "tokenizer_config.json").exists()
