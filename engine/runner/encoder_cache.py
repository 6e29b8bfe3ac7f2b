"""The encoder cache: an image's span rows, computed once, reused across chunks.

The vision tower (ViT, aligner, span vectors: ``encode_image``) turns one image
into the ``T`` rows its span feeds the language model. A prompt's span may be
cut by chunked prefill, replayed after a prefix hit or a preemption, and the
reference runner recomputes every row each step; all of them read the rows
here, keyed by the image's content hash, so the tower runs once per image while
the rows stay cached. Choices of one request (``n > 1``) and requests sending
the same pixels share an entry.

Bounded in bytes, LRU: entries of images no running sequence holds go first;
an entry larger than the whole cache is handed out but not kept. An evicted
image is encoded again when next needed (the same rows: the tower is a function
of the patches).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.model.deepseek_v41.vision.image_processor import ProcessedImage

Encode = Callable[[ProcessedImage], torch.Tensor]


@dataclass(slots=True)
class _Entry:
    rows: torch.Tensor  # [T, hidden]
    holders: set[int] = field(default_factory=set)  # sequences that may still read it

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


class EncoderCache:
    """content hash -> span rows, under ``capacity_bytes``; ``encode`` fills a miss."""

    def __init__(self, capacity_bytes: int, encode: Encode) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"an encoder cache needs at least one byte, not {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._encode = encode
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.bytes = 0
        self.encodes = 0  # vision-tower runs
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self._entries

    def rows(self, seq_id: int, image: ProcessedImage) -> torch.Tensor:
        """The span rows of ``image`` [T, hidden], read by sequence ``seq_id``."""
        key = image.content_hash
        entry = self._entries.get(key)
        if entry is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            entry.holders.add(seq_id)
            return entry.rows
        rows = self._encode(image)
        self.encodes += 1
        entry = _Entry(rows, {seq_id})
        if entry.nbytes > self.capacity_bytes:
            return rows  # never fits: the caller uses it once
        self._make_room(entry.nbytes)
        self._entries[key] = entry
        self.bytes += entry.nbytes
        return rows

    def release(self, seq_id: int) -> None:
        """``seq_id`` finished or was preempted: its entries become the first to go
        (they stay, for its resume and for the next request with the same image)."""
        for entry in self._entries.values():
            entry.holders.discard(seq_id)

    def _make_room(self, nbytes: int) -> None:
        """Evict, least recent first, unheld entries and then held ones, until ``nbytes``
        more fit (a held entry evicted is encoded again if its sequence needs it)."""
        for held in (False, True):
            for key in [k for k, e in self._entries.items() if bool(e.holders) == held]:
                if self.bytes + nbytes <= self.capacity_bytes:
                    return
                self.bytes -= self._entries.pop(key).nbytes
                self.evictions += 1
