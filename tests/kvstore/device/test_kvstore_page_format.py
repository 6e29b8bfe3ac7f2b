"""Page layout: all records' data, then all their scales (docs/design/architecture.md §1.10)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore_helpers import official_layout, tiny_layout

from kvstore import pack_records, record_views, unpack_page
from kvstore.device.device_pool import DevicePool


def test_pack_small_hand_example() -> None:
    # Two 3-byte records: 2 data bytes + 1 scale byte each.
    records = torch.tensor([[1, 2, 9], [3, 4, 8]], dtype=torch.uint8)
    assert pack_records(records, 2).tolist() == [1, 2, 3, 4, 9, 8]


@settings(max_examples=50, deadline=None)
@given(
    n=st.integers(1, 40),
    rec=st.integers(1, 40),
    data_frac=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**31),
)
def test_unpack_inverts_pack(n: int, rec: int, data_frac: float, seed: int) -> None:
    data = max(1, int(rec * data_frac))
    g = torch.Generator().manual_seed(seed)
    records = torch.randint(0, 256, (n, rec), dtype=torch.uint8, generator=g)
    page = pack_records(records, data)
    # Independent oracle: concatenate by Python lists.
    expect = [b for r in records.tolist() for b in r[:data]]
    expect += [b for r in records.tolist() for b in r[data:]]
    assert page.tolist() == expect
    assert torch.equal(unpack_page(page, rec, data), records)


def test_main_record_page_of_official_sizes() -> None:
    records = torch.randint(0, 256, (32, 288), dtype=torch.uint8)
    page = pack_records(records, 256)
    assert torch.equal(page[: 32 * 256].view(32, 256), records[:, :256])
    assert torch.equal(page[32 * 256 :].view(32, 32), records[:, 256:])


def test_views_write_the_device_row_in_place() -> None:
    layout = tiny_layout()
    pool = DevicePool(layout, num_pages=3)
    src = layout.source(4)
    pages = pool.source(4)
    main_rec = torch.randint(0, 256, (64, 288), dtype=torch.uint8)
    index_rec = torch.randint(0, 256, (64, 68), dtype=torch.uint8)
    # Write page 1 record by record through the data/scale views, as a kernel would.
    pages.main_data[1] = main_rec[:, :256]
    pages.main_scales[1] = main_rec[:, 256:]
    pages.index_data[1] = index_rec[:, :64]
    pages.index_scales[1] = index_rec[:, 64:]
    main_off, index_off = layout.offsets(4)
    row = pool.pages[1]
    main_page = row[main_off : main_off + src.main_page_bytes(64)]
    index_page = row[index_off : index_off + src.index_page_bytes(64)]
    assert torch.equal(main_page, pack_records(main_rec, 256))
    assert torch.equal(index_page, pack_records(index_rec, 64))
    assert pool.pages[0].count_nonzero() == 0 and pool.pages[2].count_nonzero() == 0


def test_bf16_pages_have_no_scale_block() -> None:
    layout = official_layout(kv_dtype="bf16")
    pool = DevicePool(layout, num_pages=1)
    pages = pool.source(20)
    assert pages.main_data.shape == (1, 64, 1024) and pages.main_scales.shape == (1, 64, 0)
    records = torch.randint(0, 256, (5, 1024), dtype=torch.uint8)
    assert torch.equal(pack_records(records, 1024), records.reshape(-1))
    data, scales = record_views(pack_records(records, 1024).unsqueeze(0), 1024, 1024)
    assert torch.equal(data[0], records) and scales.numel() == 0
