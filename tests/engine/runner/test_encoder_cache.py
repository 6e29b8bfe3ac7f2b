"""The encoder cache: one encode per image content, bounded in bytes, LRU with the
images no sequence holds going first. The "tower" here is a counting stub whose
rows are a function of the image, so a wrong entry is visible in the rows."""

from __future__ import annotations

import pytest
import torch

from engine.model.deepseek_v41.vision.image_plan import ImagePlan
from engine.model.deepseek_v41.vision.image_processor import ProcessedImage
from engine.runner.encoder_cache import EncoderCache

ROW_BYTES = 8 * 4  # [T, 8] float32 rows


def _image(tag: int, tokens_w: int = 1) -> ProcessedImage:
    """An image whose span has ``1 * (tokens_w + 1) + 2`` rows."""
    plan = ImagePlan(42 * tokens_w, 42, 42 * tokens_w, 42, 14, 3)
    return ProcessedImage(plan, torch.zeros(plan.n_patches, 588), bytes([tag]) * 32)


class _Tower:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, image: ProcessedImage) -> torch.Tensor:
        tag = image.content_hash[0]
        self.calls.append(tag)
        return torch.full((image.tokens, 8), float(tag))


def test_one_encode_per_content_whoever_reads_it() -> None:
    tower = _Tower()
    cache = EncoderCache(1 << 20, tower)
    for seq_id in (1, 1, 2):  # chunks of one sequence, then another choice
        rows = cache.rows(seq_id, _image(5))
        assert rows.shape == (4, 8) and bool((rows == 5).all())
    assert cache.rows(3, _image(6))[0, 0] == 6
    assert tower.calls == [5, 6] and (cache.encodes, cache.hits) == (2, 2)


def test_bounded_in_bytes_unheld_images_go_first() -> None:
    tower = _Tower()
    cache = EncoderCache(3 * 4 * ROW_BYTES, tower)  # three 4-row entries
    for seq_id, tag in ((1, 1), (2, 2), (3, 3)):
        cache.rows(seq_id, _image(tag))
    cache.release(1)  # 1 is the oldest, 2 the next: 1 goes, unheld
    cache.rows(1, _image(2))  # 2 becomes the most recent
    cache.rows(4, _image(4))
    assert bytes([1]) * 32 not in cache and bytes([2]) * 32 in cache
    assert cache.bytes == 3 * 4 * ROW_BYTES and cache.evictions == 1
    # Nothing unheld: the least recent held entry (3) goes; it is encoded again if read.
    cache.rows(5, _image(5))
    assert bytes([3]) * 32 not in cache
    cache.rows(3, _image(3))
    assert tower.calls == [1, 2, 3, 4, 5, 3]


def test_an_image_larger_than_the_cache_is_served_but_not_kept() -> None:
    tower = _Tower()
    cache = EncoderCache(4 * ROW_BYTES, tower)
    big = _image(9, tokens_w=3)  # 1 * 4 + 2 = 6 rows
    assert cache.rows(1, big).shape == (6, 8)
    assert len(cache) == 0 and cache.bytes == 0
    cache.rows(1, _image(1))
    assert len(cache) == 1


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        EncoderCache(0, _Tower())
