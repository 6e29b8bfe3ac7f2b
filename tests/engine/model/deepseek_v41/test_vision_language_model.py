"""Image positions inside the language model: the router's ``bias_vl``, Engram's
dead positions and the span rows that replace the embeddings. Each is checked
against a second code path written here (a hand-swapped bias, hand-padded
n-grams, an embedding table edited to hold the image rows)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.engram import engram_hash_windows
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.moe import Gate
from engine.model.deepseek_v41.vision.config import VisionConfig, image_token_id, with_vision
from engine.model.kv.dense_backend import DenseKV
from engine.model.semantics.replay import ReplayPlan

IMG = 128_900  # a placeholder id of the tiny config (any id works: rows are found by equality)


def _vision_config(engram: bool = True) -> ModelConfig:
    config = ModelConfig.tiny()
    if not engram:
        config = config.replace(engram_layer_ids=[], engram_num_embeddings=[])
    return with_vision(config, VisionConfig.tiny(), token_id=IMG)


_VOCAB: list[torch.Tensor] = []


@pytest.fixture(autouse=True, scope="module")
def _vocab(tiny_model) -> None:
    """The session's Engram class map (building it costs seconds)."""
    _VOCAB[:] = [tiny_model.engram_vocab_map]


@functools.lru_cache(maxsize=2)
def _model(engram: bool = True, seed: int = 0) -> DeepseekV41:
    """A random tiny model with a vision tower, bias_vl random; shared: copy before editing."""
    config = _vision_config(engram)
    model = DeepseekV41(config)
    model.init_weights(torch.Generator().manual_seed(seed), std=0.05)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.gate.bias_vl.copy_(torch.randn(config.n_routed_experts, generator=g))
    if config.engram_layer_ids:
        model.set_compressed_vocab(_VOCAB[0])
    return model.double().eval()


def _run(model: DeepseekV41, ids: torch.Tensor, **kw: object) -> torch.Tensor:
    """The exact (training) forward in float64."""
    kv = DenseKV(model.config, ids, ReplayPlan.exact(model.config), dtype=torch.float64)
    return model(ids, kv, **kw)


def _ids(n: int, images: slice, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(3, 120_000, (n,), generator=torch.Generator().manual_seed(seed))
    ids[images] = IMG
    return ids


def test_image_token_id_comes_from_the_config() -> None:
    assert image_token_id(ModelConfig.tiny()) is None
    assert image_token_id(_vision_config()) == IMG
    official = ModelConfig.official()
    assert image_token_id(official) == 129264
    assert official.extra["vision_config"]["hidden_size"] == 1024


def test_gate_picks_with_bias_vl_at_image_rows_only() -> None:
    config = ModelConfig.tiny()
    gate = Gate(config).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
        gate.bias.copy_(torch.randn(8, generator=g))
        gate.bias_vl.copy_(torch.randn(8, generator=g) * 3)
    x = torch.randn(40, config.hidden_size, generator=g, dtype=torch.float64)
    image = torch.arange(40) % 3 == 0
    weights, idx = gate(x, image)
    # The second path: the bias swapped by hand, and the weights from the scores.
    scores = F.softplus(x @ gate.weight.T).sqrt()
    for row in range(40):
        bias = gate.bias_vl if image[row] else gate.bias
        want = torch.topk(scores[row] + bias, 2).indices
        assert idx[row].tolist() == want.tolist()
        picked = scores[row, want]
        assert torch.allclose(weights[row], picked / picked.sum() * 1.5)
    plain_weights, plain_idx = gate(x)
    assert not torch.equal(idx[image], plain_idx[image])  # bias_vl changed some picks
    assert torch.equal(idx[~image], plain_idx[~image])
    assert torch.equal(weights[~image], plain_weights[~image])


class _HandGate(torch.nn.Module):
    """A router that looks at each row's token id itself: rows of the placeholder take
    the picks of a copy whose ``bias`` was overwritten with ``bias_vl``."""

    def __init__(self, gate: Gate, ids: torch.Tensor) -> None:
        super().__init__()
        self.text, self.vl, self.ids = gate, copy.deepcopy(gate), ids
        with torch.no_grad():
            self.vl.bias.copy_(gate.bias_vl)

    def forward(self, x, image_rows=None):
        assert image_rows is None  # the model under test does not know the image id
        (tw, ti), (vw, vi) = self.text(x), self.vl(x)
        image = [int(t) == IMG for t in self.ids]
        rows = range(x.shape[0])
        return (
            torch.stack([vw[r] if image[r] else tw[r] for r in rows]),
            torch.stack([vi[r] if image[r] else ti[r] for r in rows]),
        )


def test_model_routes_image_rows_with_bias_vl() -> None:
    """The whole forward against a copy that knows no image id and whose routers
    swap the bias row by row by hand (Engram off: it has its own rule)."""
    model = _model(engram=False)
    ids = _ids(14, slice(4, 10))
    got = _run(model, ids)
    hand = copy.deepcopy(model)
    hand.image_token_id = None
    for block in hand.blocks:
        block.ffn.gate = _HandGate(block.ffn.gate, ids)  # type: ignore[assignment]
    torch.testing.assert_close(got, _run(hand, ids), atol=1e-10, rtol=0)
    text = copy.deepcopy(model)
    text.image_token_id = None
    assert (got - _run(text, ids)).abs().max() > 1e-3  # bias_vl did change the answer


def test_the_ids_next_to_the_placeholder_are_text() -> None:
    model = _model()
    text = copy.deepcopy(model)
    text.image_token_id = None
    for neighbour in (IMG - 1, IMG + 1):
        ids = _ids(20, slice(4, 12))
        ids[4:12] = neighbour
        torch.testing.assert_close(_run(model, ids), _run(text, ids), atol=0, rtol=0)


def test_engram_look_back_stops_at_an_image_position() -> None:
    """As the public ports pin it: an image token at position 5 changes the n-grams of
    positions 5..8 (n = 4) and no other."""
    model = _model()
    layer = model.config.engram_layer_ids[0]
    ids = _ids(14, slice(0, 0))
    dead = ids.clone()
    dead[5] = IMG
    a = model.engram_rows(ids, 0, 14, layer)
    b = model.engram_rows(dead, 0, 14, layer)
    changed = (a != b).any(dim=1).nonzero().flatten().tolist()
    assert changed == [5, 6, 7, 8]
    # Second path: pad the cut slots by hand and hash. Position 7 sees 4..7; the
    # image at 5 cuts 5 and everything older (4), so its window is pad, pad, 6, 7.
    classes = model.engram_vocab_map
    pad = int(classes[model.config.engram_pad_token_id])
    want = torch.tensor([[pad, pad, int(classes[dead[6]]), int(classes[dead[7]])]])
    assert torch.equal(b[7:8], engram_hash_windows(want, model.config, layer))
    assert torch.equal(b[5:6], engram_hash_windows(torch.full((1, 4), pad), model.config, layer))


def test_engram_gate_is_shut_at_image_rows() -> None:
    model = _model()
    engram = model.block(model.config.engram_layer_ids[0]).engram
    assert engram is not None
    g = torch.Generator().manual_seed(3)
    R = torch.randn(6, 4, 256, generator=g, dtype=torch.float64)
    rows = torch.randint(0, 500, (6, engram.n_columns), generator=g)
    live = torch.tensor([True, False, True, True, False, True])
    out = engram(R, rows, live)
    assert torch.equal(out[~live], R[~live])  # passed through untouched
    assert torch.equal(out[live], engram(R, rows)[live])
    assert not torch.allclose(out[live], R[live])


def test_image_rows_replace_the_embeddings_before_the_streams() -> None:
    """Second path: an embedding table whose placeholder row holds the image vector."""
    model = _model()
    ids = _ids(18, slice(6, 11))
    vector = torch.randn(256, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    got = _run(model, ids, image_embeds=vector.expand(5, 256))
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.embed.weight[IMG] = vector
    torch.testing.assert_close(got, _run(edited, ids), atol=0, rtol=0)
    rows = torch.randn(5, 256, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    x = model.input_embeddings(ids, rows)
    assert torch.equal(x[6:11], rows) and torch.equal(x[:6], model.embed(ids[:6]))
    with pytest.raises(ValueError, match="4 image rows for 5"):
        _run(model, ids, image_embeds=rows[:4])
