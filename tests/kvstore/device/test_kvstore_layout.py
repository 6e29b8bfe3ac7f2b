"""KVLayout: bytes per token, offsets, fingerprint (docs/design/architecture.md §1.10)."""

from __future__ import annotations

import itertools

import pytest
from kvstore_helpers import official_layout, tiny_layout

from engine.model.deepseek_v41.config import ModelConfig
from kvstore import KVLayout, SourceLayout, kv_layout


def test_bytes_per_token_official_is_890() -> None:
    # Hand count from docs/design/architecture.md §1.10: three ratio-2 sources and one
    # ratio-1 source.
    main = 3 * 288 / 2 + 288
    index = 3 * 68 / 2 + 68
    assert main + index == 890
    assert official_layout().bytes_per_token == 890
    cfg = ModelConfig.official()
    assert kv_layout(cfg.kv_source_layer_ids, cfg.compress_ratios).bytes_per_token == 890


def test_bytes_per_token_tiny_is_534() -> None:
    assert (288 + 68) / 2 + (288 + 68) == 534
    assert tiny_layout().bytes_per_token == 534
    cfg = ModelConfig.tiny()
    assert kv_layout(cfg.kv_source_layer_ids, cfg.compress_ratios).bytes_per_token == 534


def test_bf16_ablation_record_sizes() -> None:
    # 512 bf16 latent = 1024 B, 128 bf16 key = 256 B, no scales.
    layout = official_layout(kv_dtype="bf16")
    assert layout.bytes_per_token == 3 * (1024 + 256) / 2 + (1024 + 256)
    assert all(s.main_data_bytes == s.main_record_bytes == 1024 for s in layout.sources)
    assert all(s.index_data_bytes == s.index_record_bytes == 256 for s in layout.sources)


def test_page_bytes_and_entries() -> None:
    layout = official_layout()
    # 64-token page: ratio-2 sources hold 32 entries, layer 20 holds 64.
    assert [s.entries_per_page(64) for s in layout.sources] == [32, 32, 32, 64]
    assert layout.entries_per_page == 160
    assert layout.page_bytes == 160 * (288 + 68) == 890 * 64


def test_offsets_tile_the_page_row() -> None:
    layout = official_layout()
    spans = []
    for s in layout.sources:
        main_off, index_off = layout.offsets(s.layer_id)
        spans.append((main_off, main_off + s.main_page_bytes(64)))
        spans.append((index_off, index_off + s.index_page_bytes(64)))
    spans.sort()
    assert spans[0][0] == 0 and spans[-1][1] == layout.page_bytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_page_tokens_must_be_multiple_of_every_ratio() -> None:
    with pytest.raises(ValueError, match="multiple"):
        tiny_layout(page_tokens=63)
    tiny_layout(page_tokens=2)  # smallest legal page for ratios {1, 2}


def test_locate_entry() -> None:
    layout = tiny_layout()
    src2, src4 = layout.source(2), layout.source(4)
    table = [7, 3, 9]
    # Ratio 2: 32 entries per page; entry 33 covers tokens 66-67 -> page 1, slot 1.
    assert src2.locate(33, table, 64) == (3, 1)
    # Ratio 1: 64 entries per page; entry 130 -> page 2, slot 2.
    assert src4.locate(130, table, 64) == (9, 2)


def test_fingerprint_tracks_every_byte_determining_field() -> None:
    base = tiny_layout()
    variants = [
        tiny_layout(page_tokens=32),
        tiny_layout(kv_dtype="bf16"),
        tiny_layout(model_id="other-checkpoint"),
        KVLayout(64, (SourceLayout(2, 2), SourceLayout(5, 1))),
        KVLayout(64, (SourceLayout(2, 2), SourceLayout(4, 2))),
    ]
    prints = {v.fingerprint for v in variants}
    assert base.fingerprint not in prints and len(prints) == len(variants)
    assert tiny_layout().fingerprint == base.fingerprint
