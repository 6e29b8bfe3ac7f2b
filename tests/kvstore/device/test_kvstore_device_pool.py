"""Device pool byte accounting: pool bytes / token capacity == global KV bytes per token."""

from __future__ import annotations

import pytest
import torch
from kvstore_helpers import official_layout, tiny_layout

from kvstore import open_local_kv, pages_for_bytes
from kvstore.device.device_pool import DevicePool


@pytest.mark.parametrize(
    ("make", "per_token"),
    [(official_layout, 890), (tiny_layout, 534)],
    ids=["official", "tiny"],
)
def test_measured_pool_bytes_per_token(make, per_token: int) -> None:
    layout = make()
    # A budget that is not a whole number of pages: the remainder is not allocated.
    kv, pool = open_local_kv(layout, cache_bytes=5 * layout.page_bytes + 1000)
    tensor = pool.pages
    measured = tensor.numel() * tensor.element_size()
    capacity_tokens = kv.num_pages * layout.page_tokens
    assert kv.num_pages == 5
    assert measured / capacity_tokens == per_token
    assert kv.stats().device_bytes == measured


def test_pages_for_bytes_floors() -> None:
    layout = tiny_layout()
    assert pages_for_bytes(layout, layout.page_bytes - 1) == 0
    assert pages_for_bytes(layout, 3 * layout.page_bytes) == 3
    with pytest.raises(ValueError, match="holds no page"):
        open_local_kv(layout, cache_bytes=layout.page_bytes - 1)


def test_source_views_partition_the_row() -> None:
    layout = official_layout()
    pool = DevicePool(layout, num_pages=2)
    owner = torch.zeros(layout.page_bytes, dtype=torch.int64)
    for k, s in enumerate(layout.sources):
        v = pool.source(s.layer_id)
        for j, view in enumerate((v.main_data, v.main_scales, v.index_data, v.index_scales)):
            view[1].fill_(1)
            marked = pool.pages[1].nonzero().flatten()
            owner[marked] += 1
            pool.pages[1].zero_()
            assert view.shape[1] == s.entries_per_page(64), (k, j)
    # Every byte of the row belongs to exactly one view.
    assert torch.equal(owner, torch.ones_like(owner))
    assert pool.pages[0].count_nonzero() == 0


def test_views_share_storage_with_the_pool() -> None:
    layout = tiny_layout()
    pool = DevicePool(layout, num_pages=2)
    v = pool.source(2)
    assert v.main.untyped_storage().data_ptr() == pool.pages.untyped_storage().data_ptr()
    assert v.main.stride(0) == layout.page_bytes
