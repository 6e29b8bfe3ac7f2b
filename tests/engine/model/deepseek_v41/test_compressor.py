from __future__ import annotations

import math

import pytest
import torch

from engine.model.deepseek_v41.compressor import Compressor, entry_positions
from engine.model.deepseek_v41.config import ModelConfig

RATIO2_LAYER, RATIO1_LAYER = 2, 4  # tiny config: layer 2 is ratio 2, layer 4 ratio 1


def _random_compressor(layer_id: int, seed: int) -> Compressor:
    comp = Compressor(ModelConfig.tiny(), layer_id)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in comp.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return comp


def _oracle(comp: Compressor, x: torch.Tensor) -> torch.Tensor:
    """Float64, one group at a time, channel by channel.

    As docs/design/architecture.md §1.6 writes it.
    """
    r, eps = comp.ratio, comp.norm.eps
    wkv = comp.wkv.weight.double()
    out = []
    for j in range(x.shape[0] // r):
        if r == 1:
            pooled = wkv @ x[j].double()
        else:
            wg = comp.wgate.weight.double()
            a0, a1 = wkv @ x[2 * j].double(), wkv @ x[2 * j + 1].double()
            g0, g1 = wg @ x[2 * j].double(), wg @ x[2 * j + 1].double()
            s0 = torch.exp(g0) / (torch.exp(g0) + torch.exp(g1))
            pooled = s0 * a0 + (1 - s0) * a1
        rms = torch.sqrt((pooled**2).mean() + eps)
        out.append(pooled / rms * comp.norm.weight.double())
    return torch.stack(out) if out else torch.zeros(0, comp.head_dim, dtype=torch.float64)


@pytest.mark.parametrize("layer_id", [RATIO2_LAYER, RATIO1_LAYER])
@pytest.mark.parametrize("T", [1, 2, 7, 8])
def test_forward_matches_per_group_loop(layer_id, T):
    comp = _random_compressor(layer_id, seed=layer_id)
    x = torch.randn(T, 256, generator=torch.Generator().manual_seed(T)) * 2
    got = comp(x)
    assert got.shape == (T // comp.ratio, 512) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), _oracle(comp, x), rtol=1e-5, atol=1e-5)


def test_ratio1_has_no_gate_and_ratio2_projects_kv_then_gate():
    c1, c2 = _random_compressor(RATIO1_LAYER, 0), _random_compressor(RATIO2_LAYER, 1)
    assert c1.wgate is None and c1.ratio == 1
    assert c2.wgate is not None and c2.ratio == 2
    x = torch.randn(3, 256)
    rows = c2.project(x)
    assert rows.shape == (3, 1024) and rows.dtype == torch.float32
    torch.testing.assert_close(rows[:, :512], x @ c2.wkv.weight.T)
    torch.testing.assert_close(rows[:, 512:], x @ c2.wgate.weight.T)
    assert c1.project(x).shape == (3, 512)
    with pytest.raises(ValueError):
        Compressor(ModelConfig.tiny(), 0)  # a ratio-0 layer owns no compressor


def test_project_combine_streams_like_forward():
    # The engine keeps the open group's raw row as state and emits later.
    comp = _random_compressor(RATIO2_LAYER, seed=9)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(10))
    whole = comp(x)  # 4 entries; token 8 is pending
    rows = comp.project(x)
    torch.testing.assert_close(comp.combine(rows[:8], x.dtype), whole, rtol=0, atol=0)
    # Chunks [0, 3) | [3, 5) | [5, 9): each starts with the previous chunk's pending row.
    emitted, pending = [], None
    for lo, hi in ((0, 3), (3, 5), (5, 9)):
        chunk = rows[lo:hi] if pending is None else torch.cat([pending, rows[lo:hi]])
        complete = chunk.shape[0] // 2 * 2
        emitted.append(comp.combine(chunk[:complete], torch.float32))
        pending = chunk[complete:] if complete < chunk.shape[0] else None
    torch.testing.assert_close(torch.cat(emitted), whole, rtol=0, atol=0)
    assert pending is not None and torch.equal(pending, rows[8:9])


def test_gate_softmax_is_per_channel():
    # Channel 0 gates toward token 0, channel 1 toward token 1.
    comp = Compressor(ModelConfig.tiny(), RATIO2_LAYER)
    with torch.no_grad():
        comp.norm.weight.fill_(1.0)
    rows = torch.zeros(2, 1024)
    rows[0, :512], rows[1, :512] = 1.0, -1.0  # a
    rows[0, 512], rows[1, 512] = 50.0, 0.0  # g, channel 0
    rows[0, 513], rows[1, 513] = 0.0, 50.0  # g, channel 1
    with torch.no_grad():
        pooled_dir = comp.combine(rows, torch.float32)[0]
    assert pooled_dir[0] > 0 and pooled_dir[1] < 0 and abs(float(pooled_dir[2])) < 1e-6


def test_entry_positions_are_group_starts():
    assert entry_positions(4, 2).tolist() == [0, 2, 4, 6]
    assert entry_positions(3, 2, start_entry=5).tolist() == [10, 12, 14]
    assert Compressor.entry_positions(3, 1, start_entry=7).tolist() == [7, 8, 9]
    assert entry_positions(0, 2).tolist() == []
