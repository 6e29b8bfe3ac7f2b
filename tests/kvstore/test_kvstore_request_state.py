"""Per-request SWA rings and compressor rows: sizes, isolation, reuse."""

from __future__ import annotations

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig
from kvstore import OutOfRequestSlots, RequestStateLayout, RequestStatePool


def test_official_sizes() -> None:
    cfg = ModelConfig.official()
    layout = RequestStateLayout.for_model(
        swa_layers=cfg.num_hidden_layers,
        sliding_window=cfg.sliding_window,
        kv_source_ratios=[cfg.compress_ratios[l] for l in cfg.kv_source_layer_ids],
        head_dim=cfg.head_dim,
    )
    # docs/design/architecture.md §1.10: 128 x 528 B x 40 layers ~ 2.7 MB of SWA per request.
    assert layout.swa_bytes == 128 * 528 * 40 == 2_703_360
    # Three ratio-2 sources keep one open [a | g] row of 2 x 512 fp32 each.
    assert (layout.compressor_sources, layout.compressor_rows) == (3, 1)
    assert layout.compressor_bytes == 3 * 1024 * 4
    pool = RequestStatePool(layout, max_requests=2)
    assert pool.nbytes == 2 * (layout.swa_bytes + layout.compressor_bytes)


def _pool(n: int = 3) -> RequestStatePool:
    layout = RequestStateLayout(
        swa_layers=3, sliding_window=4, compressor_sources=2, compressor_row_width=8
    )
    return RequestStatePool(layout, max_requests=n)


def test_requests_are_isolated_and_slots_reused_zeroed() -> None:
    pool = _pool()
    pool.allocate("a")
    pool.allocate("b")
    pool.swa_window(1, "a")[2] = 7
    pool.compressor_state(0, "a").fill_(1.5)
    assert pool.swa_window(1, "b").count_nonzero() == 0
    assert pool.compressor_state(0, "b").count_nonzero() == 0
    # The write lands in ring entry 2 of a's window and only there.
    assert pool.swa_window(1, "a")[:, 0].tolist() == [0, 0, 7, 0]
    slot = pool.slot("a")
    pool.free("a")
    pool.allocate("c")
    pool.allocate("d")
    assert slot in {pool.slot("c"), pool.slot("d")}
    assert pool.swa.count_nonzero() == 0 and pool.compressor.count_nonzero() == 0


def test_views_alias_the_slabs() -> None:
    pool = _pool()
    pool.allocate("a")
    pool.swa_window(2, "a")[3, 5] = 9
    assert pool.swa[2, pool.slot("a"), 3, 5] == 9
    pool.compressor_state(1, "a")[0, 2] = torch.tensor(2.5)
    assert pool.compressor[1, pool.slot("a"), 0, 2] == 2.5


def test_out_of_slots() -> None:
    pool = _pool(n=1)
    pool.allocate("a")
    with pytest.raises(OutOfRequestSlots):
        pool.allocate("b")
    pool.free("a")
    assert pool.allocate("b") == 0
    with pytest.raises(OutOfRequestSlots):
        pool.allocate("c")
