"""Byte layout of the paged global KV (docs/design/architecture.md §1.10, §2.3).

The kvstore knows bytes, not the model: the engine describes each kv source
with plain numbers and we derive every size from them. A page covers
``page_tokens`` input tokens of every kv source; page ``p`` of the pool is one
contiguous row holding, per source in order, its main-record page then its
index-key page, each laid out as "all records' data, then all their scales".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import blake3

from kernels.kv_formats import INDEX_KEY, MAIN_KV, global_kv_records

# Bumped whenever the meaning of a page's bytes changes; part of the fingerprint.
LAYOUT_VERSION = 1

KVDtype = Literal["fp4", "bf16"]


@dataclass(frozen=True, slots=True)
class SourceLayout:
    """One kv source layer: its compress ratio and the sizes of its two records."""

    layer_id: int
    compress_ratio: int
    main_record_bytes: int = MAIN_KV.record_bytes
    main_data_bytes: int = MAIN_KV.data_bytes
    index_record_bytes: int = INDEX_KEY.record_bytes
    index_data_bytes: int = INDEX_KEY.data_bytes

    def __post_init__(self) -> None:
        if self.compress_ratio < 1:
            raise ValueError(f"kv source {self.layer_id}: compress ratio must be >= 1")
        for rec, data in (
            (self.main_record_bytes, self.main_data_bytes),
            (self.index_record_bytes, self.index_data_bytes),
        ):
            if not 0 < data <= rec:
                raise ValueError(f"kv source {self.layer_id}: need 0 < data bytes <= record bytes")

    @property
    def record_bytes(self) -> int:
        """Bytes one compressed entry costs: main record plus index key."""
        return self.main_record_bytes + self.index_record_bytes

    def entries_per_page(self, page_tokens: int) -> int:
        return page_tokens // self.compress_ratio

    def main_page_bytes(self, page_tokens: int) -> int:
        return self.entries_per_page(page_tokens) * self.main_record_bytes

    def index_page_bytes(self, page_tokens: int) -> int:
        return self.entries_per_page(page_tokens) * self.index_record_bytes

    def locate(self, entry: int, block_table: Sequence[int], page_tokens: int) -> tuple[int, int]:
        """(page id, slot) of compressed entry ``entry`` (tokens [entry r, (entry+1) r))."""
        per_page = self.entries_per_page(page_tokens)
        return block_table[entry // per_page], entry % per_page


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Every kv source of a model, the page size, and who the bytes belong to.

    ``model_id`` is an identity string the engine passes (checkpoint name or
    weights hash): pages of two models with equal shapes must not mix.
    """

    page_tokens: int
    sources: tuple[SourceLayout, ...]
    model_id: str = ""

    def __post_init__(self) -> None:
        if self.page_tokens < 1 or not self.sources:
            raise ValueError("a KV layout needs page_tokens >= 1 and at least one kv source")
        for s in self.sources:
            if self.page_tokens % s.compress_ratio:
                raise ValueError(
                    f"page_tokens={self.page_tokens} is not a multiple of kv source "
                    f"{s.layer_id}'s compress ratio {s.compress_ratio}"
                )
        ids = [s.layer_id for s in self.sources]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate kv source layer ids {ids}")

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all sources (one row of the device pool)."""
        return sum(
            s.main_page_bytes(self.page_tokens) + s.index_page_bytes(self.page_tokens)
            for s in self.sources
        )

    @property
    def bytes_per_token(self) -> float:
        """Global KV bytes per input token: sum over sources of (main + index) / ratio."""
        return self.page_bytes / self.page_tokens

    @property
    def entries_per_page(self) -> int:
        """Compressed entries of all sources in one page (the file header's count)."""
        return sum(s.entries_per_page(self.page_tokens) for s in self.sources)

    def source(self, layer_id: int) -> SourceLayout:
        for s in self.sources:
            if s.layer_id == layer_id:
                return s
        raise KeyError(f"layer {layer_id} is not a kv source of this layout")

    def offsets(self, layer_id: int) -> tuple[int, int]:
        """Byte offsets inside a page row of ``layer_id``'s main page and index page."""
        off = 0
        for s in self.sources:
            main_bytes = s.main_page_bytes(self.page_tokens)
            if s.layer_id == layer_id:
                return off, off + main_bytes
            off += main_bytes + s.index_page_bytes(self.page_tokens)
        raise KeyError(f"layer {layer_id} is not a kv source of this layout")

    @property
    def fingerprint(self) -> str:
        """Hex digest (32 chars) of every field that determines a page's bytes."""
        return self.fingerprint_bytes.hex()

    @property
    def fingerprint_bytes(self) -> bytes:
        desc = {
            "version": LAYOUT_VERSION,
            "page_tokens": self.page_tokens,
            "sources": [
                [
                    s.layer_id,
                    s.compress_ratio,
                    s.main_record_bytes,
                    s.main_data_bytes,
                    s.index_record_bytes,
                    s.index_data_bytes,
                ]
                for s in self.sources
            ],
            "model_id": self.model_id,
        }
        text = json.dumps(desc, sort_keys=True, separators=(",", ":"))
        return blake3.blake3(text.encode("utf-8")).digest(length=16)


def kv_layout(
    kv_source_layer_ids: Sequence[int],
    compress_ratios: Sequence[int],
    page_tokens: int = 64,
    kv_dtype: KVDtype = "fp4",
    model_id: str = "",
) -> KVLayout:
    """Layout from the config's plain lists (``compress_ratios`` is indexed by layer id)."""
    main, index = global_kv_records(kv_dtype)
    sources = tuple(
        SourceLayout(
            layer_id=layer,
            compress_ratio=compress_ratios[layer],
            main_record_bytes=main.record_bytes,
            main_data_bytes=main.data_bytes,
            index_record_bytes=index.record_bytes,
            index_data_bytes=index.data_bytes,
        )
        for layer in kv_source_layer_ids
    )
    return KVLayout(page_tokens=page_tokens, sources=sources, model_id=model_id)
