"""The C index-key decode against the eager decode of the same pages, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_index_keys, cpu_native, kv_cache_ops
from kernels.kv_formats import dequantize_index_key, quantize_index_key

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler")


def _pages(P: int = 9, E: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index-key page views inside a larger buffer (page stride > record bytes), as the
    KV store lays them out, filled with keys over a wide range of magnitudes."""
    gen = torch.Generator().manual_seed(0)
    stride = E * 68 + 40
    buf = torch.zeros(P * stride + 7, dtype=torch.uint8)
    base = buf[7:].view(P, stride)
    data = base[:, : E * 64].view(P, E, 64)
    scales = base[:, E * 64 : E * 68].view(P, E, 4)
    keys = torch.randn(P * E, 128, generator=gen) * torch.logspace(-35, 35, P * E)[:, None]
    rec = quantize_index_key(keys)
    data.copy_(rec[:, :64].reshape(P, E, 64))
    scales.copy_(rec[:, 64:].reshape(P, E, 4))
    return data, scales, rec.view(P, E, 68)


def test_c_decode_equals_the_eager_decode_bitwise(monkeypatch) -> None:
    data, scales, rec = _pages()
    scales[2, 3, 1] = 0xFF  # a NaN scale byte: its 32 values decode to NaN either way
    pages = torch.tensor([[4, 0, 8], [2, 2, 5]])
    assert cpu_index_keys.usable(data, scales, pages)
    got = kv_cache_ops.read_index_pages(data, scales, pages)
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    want = kv_cache_ops.read_index_pages(data, scales, pages)
    assert got.shape == want.shape == (2, 3, 8, 128)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # NaNs included
    # And the records' own decode (the independent path over joined 68-byte records).
    torch.testing.assert_close(got[0, 0], dequantize_index_key(rec[4]), equal_nan=True)
    assert got[1, 0, 3, 32:64].isnan().all() and not got[1, 0, 3, :32].isnan().any()


def test_out_of_range_pages_raise_instead_of_reading_past_the_pool() -> None:
    data, scales, _ = _pages()
    with pytest.raises(IndexError):
        cpu_index_keys.read_index_pages(data, scales, torch.tensor([0, 9]))


def test_layouts_it_does_not_know_stay_eager(monkeypatch) -> None:
    data, scales, _ = _pages()
    assert not cpu_index_keys.usable(data, scales, torch.tensor([0], dtype=torch.int32))
    assert not cpu_index_keys.usable(data.transpose(0, 1), scales, torch.tensor([0]))
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    assert not cpu_index_keys.usable(data, scales, torch.tensor([0]))


def test_blocked_scoring_on_the_c_path_equals_the_eager_scores_bitwise(monkeypatch) -> None:
    """Ragged decode rows over more keys than one C block: the same scores as the eager
    decode scored in its own (larger) blocks, so the blocking changes no value."""
    from kernels import indexer_ops

    monkeypatch.setattr(indexer_ops, "_CPU_BLOCK_KEYS", 64)  # many blocks on the C path
    data, scales, _ = _pages(P=40, E=8)
    gen = torch.Generator().manual_seed(1)
    T = 5
    qi = torch.randn(T, 4, 128, generator=gen)
    w = torch.randn(T, 4, generator=gen)
    tables = torch.stack([torch.randperm(40, generator=gen)[:30] for _ in range(T)])
    n_visible = torch.tensor([240, 3, 77, 0, 129])
    got = indexer_ops.indexer_scores_reference(qi, w, data, scales, tables, n_visible, 240)
    monkeypatch.setenv(cpu_native.ENV_VAR, "0")
    want = indexer_ops.indexer_scores_reference(qi, w, data, scales, tables, n_visible, 240)
    assert torch.equal(got, want)
    assert torch.isinf(got[1, 3:]).all() and torch.isfinite(got[1, :3]).all()


def test_scoring_rejects_a_block_table_pointing_past_the_pool() -> None:
    from kernels import indexer_ops

    data, scales, _ = _pages()
    qi, w = torch.randn(1, 4, 128), torch.randn(1, 4)
    with pytest.raises(IndexError):
        indexer_ops.indexer_scores_reference(
            qi, w, data, scales, torch.tensor([[0, 9]]), torch.tensor([16]), 16
        )
