"""Routed experts through the checkpoint: the packed load keeps the stored MXFP4 bytes.

Oracles: the shard's own bytes (read with safetensors, bypassing the loader),
the stored tensor sizes from the headers, the dequantise-at-load model
(``quantization="none"``) and ``kernels.weight_formats``' decoder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import engine.loader.checkpoint as checkpoint_module
import engine.loader.plan as plan_module
from engine.loader.checkpoint import empty_model, load_checkpoint
from engine.loader.checkpoint_writer import make_tiny, save_checkpoint, tiny_checkpoint_config
from engine.loader.files import iter_checkpoint_tensors
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.routed_experts import RoutedExperts
from engine.model.weights import WeightFormat, scale_name
from kernels.weight_formats import dequantize_mxfp4_weight

# The text layers' and the DSpark stages' routed experts (both MXFP4, both packed).
EXPERT = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.(weight|scale)")
IDS = torch.tensor([0, 5, 17, 99, 1234, 2, 64000, 7, 7, 128803, 31, 8])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=4)


@pytest.fixture(scope="module")
def stored(tiny_dir: Path) -> dict[str, torch.Tensor]:
    """Every routed expert tensor (weights and scales) as the file holds it."""
    with safe_open(tiny_dir / "model.safetensors", framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys() if EXPERT.fullmatch(n)}  # noqa: SIM118


@pytest.fixture(scope="module")
def packed(tiny_dir: Path):
    return load_checkpoint(tiny_dir)[1].eval()


@pytest.fixture(scope="module")
def dequantised(tiny_dir: Path):
    return load_checkpoint(tiny_dir, quantization="none")[1].eval()


def _experts(model) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_packed_load_keeps_the_stored_expert_bytes(packed, stored) -> None:
    config = ModelConfig.tiny()
    drafter = config.dspark_n_routed_experts * config.num_nextn_predict_layers
    assert len(stored) == 2 * 3 * (config.n_routed_experts * config.num_hidden_layers + drafter)
    assert all(e.packed for e in _experts(packed))
    state = packed.state_dict()
    for name, tensor in stored.items():
        assert state[name].dtype == tensor.dtype, name  # int8 pairs, float8_e8m0fnu scales
        assert torch.equal(_bytes(state[name]), _bytes(tensor)), name
    # The state-dict entries are views of the stacked buffers, not copies.
    experts = packed.layers[2].ffn.experts
    assert torch.equal(_bytes(experts.w2[5]), _bytes(stored["layers.2.ffn.experts.5.w2.weight"]))
    assert torch.equal(experts.w3_scale[1], _bytes(stored["layers.2.ffn.experts.1.w3.scale"]))


def test_resident_expert_bytes_equal_the_stored_expert_bytes(tiny_dir: Path, packed) -> None:
    stored = sum(t.nbytes for t in iter_checkpoint_tensors(tiny_dir) if EXPERT.fullmatch(t.name))
    resident = sum(b.nbytes for e in _experts(packed) for b in e.buffers())
    assert resident == stored
    assert not any(True for e in _experts(packed) for _ in e.parameters())
    # Four bits per weight plus one scale byte per 32: 0.53 B per parameter.
    config = ModelConfig.tiny()
    experts = config.n_routed_experts * config.num_hidden_layers
    experts += config.dspark_n_routed_experts * config.num_nextn_predict_layers  # the drafter's
    params = 3 * config.hidden_size * config.moe_intermediate_size * experts
    assert resident == params * (1 / 2 + 1 / 32)


def test_packed_load_dequantises_no_expert(tiny_dir: Path, monkeypatch) -> None:
    formats = []
    real = plan_module.dequantize

    def spy(fmt, *args):
        formats.append(fmt)
        return real(fmt, *args)

    monkeypatch.setattr(plan_module, "dequantize", spy)
    load_checkpoint(tiny_dir)
    # Packed experts and packed FP8 linears: nothing quantised is dequantised.
    assert WeightFormat.FP8_BLOCK not in formats and WeightFormat.MXFP4 not in formats
    formats.clear()
    load_checkpoint(tiny_dir, quantization="none")
    assert WeightFormat.MXFP4 in formats and WeightFormat.FP8_BLOCK in formats


def test_quantization_none_dequantises_the_experts(dequantised, stored) -> None:
    experts = dequantised.layers[3].ffn.experts
    assert not experts.packed and experts.w1.dtype == torch.float32
    for e in (0, 6):
        for name in ("w1", "w2", "w3"):
            key = f"layers.3.ffn.experts.{e}.{name}.weight"
            want = dequantize_mxfp4_weight(stored[key], stored[scale_name(key)], torch.float32)
            assert torch.equal(getattr(experts, name)[e], want), key


def test_packed_state_dict_round_trips_through_the_checkpoint(
    tmp_path: Path, tiny_dir: Path, packed, stored
) -> None:
    """save_checkpoint writes the packed bytes as they are; loading them again gives them back."""
    save_checkpoint(packed, tiny_checkpoint_config(), tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        for name, tensor in stored.items():
            again = f.get_tensor(name)
            assert again.dtype == tensor.dtype and torch.equal(_bytes(again), _bytes(tensor)), name
    _, reloaded = load_checkpoint(tmp_path)
    want = packed.state_dict()
    got = reloaded.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(_bytes(got[name]), _bytes(want[name])), name


def test_load_state_dict_fills_the_stacked_experts(packed, dequantised) -> None:
    for source, quantization in ((packed, "auto"), (dequantised, "none")):
        model = empty_model(ModelConfig.tiny(), quantization=quantization)
        model.load_state_dict(source.state_dict(), strict=False)
        got = model.layers[1].ffn.experts
        want = source.layers[1].ffn.experts
        for name, tensor in want.state_dict().items():
            assert torch.equal(_bytes(got.state_dict()[name]), _bytes(tensor)), name
    # A packed module refuses unpacked weights (float [I, D] into int8 [I, D / 2]).
    model = empty_model(ModelConfig.tiny(), quantization="auto")
    with pytest.raises(RuntimeError, match="size mismatch"):
        model.layers[1].ffn.experts.load_state_dict(
            dequantised.layers[1].ffn.experts.state_dict(), strict=False
        )


def test_packed_logits_follow_the_dequantised_model(
    tiny_dir: Path, dequantised, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same expert weights; the packed path also rounds each expert GEMM's input to E4M3
    (3 mantissa bits: relative error <= 2^-4 per element, about 2^-6 on average).
    Tolerance: the logits' relative error stays below one E4M3 step, 2^-4, after
    8 layers of it (measured 0.044 on this checkpoint), and most greedy tokens hold.
    Only the experts are packed here (the dense FP8 linears' own rounding is
    tests/engine/test_packed_linears.py)."""
    monkeypatch.setattr(checkpoint_module, "packable_weights", lambda *args: [])
    _, packed = load_checkpoint(tiny_dir)
    assert packed.layers[3].ffn.experts.packed
    with torch.no_grad():
        got, want = packed(IDS), dequantised(IDS)
    assert torch.isfinite(got).all()
    rel = (got - want).norm() / want.norm()
    assert 0 < rel < 2**-4, rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


def test_encoder_only_packed_load(tiny_dir: Path, packed) -> None:
    _, model = load_checkpoint(tiny_dir, encoder_only=True)
    kept = model.state_dict()
    full = packed.state_dict()
    assert all(e.packed for e in _experts(model))
    for name, value in kept.items():
        assert torch.equal(_bytes(value), _bytes(full[name])), name


def test_unknown_quantization_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization='fp4'"):
        load_checkpoint(tiny_dir, quantization="fp4")
