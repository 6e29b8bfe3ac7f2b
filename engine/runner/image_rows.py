"""The ``image_embeds`` of a forward: the rows of the image positions among its rows.

The model's forward takes one row per image position (the placeholder id) of
the rows it runs, in order (``DeepseekV41.input_embeddings``). A runner runs
position ranges ``[lo, hi)`` of its sequences (a chunk, a decode row, a replay
from the plan's encoder start); this gathers, per range, the part of each
image span inside it from the encoder cache (a chunk that cuts a span takes its
share, a restore that starts inside one takes the rest).

A placeholder id outside every span can only be a sampled token (validation
keeps the prompt's inside spans): it takes its own embedding, as in a text
model, so a batch mixing such a row with an image's rows stays one tensor.
"""

from __future__ import annotations

from typing import Protocol, cast

import torch

from engine.core.sequence import Sequence
from engine.model.base import CausalLM
from engine.model.deepseek_v41.vision.image_plan import ImagePlan
from engine.model.deepseek_v41.vision.image_processor import ProcessedImage
from engine.runner.encoder_cache import EncoderCache


class _VisionTower(Protocol):
    def encode_image(self, patches: torch.Tensor, plan: ImagePlan) -> torch.Tensor: ...


def encoder_cache_for(model: CausalLM, capacity_bytes: int) -> EncoderCache:
    """A cache whose misses run ``model``'s vision tower under no_grad (a model without
    one raises if ever asked: validation refuses images for it)."""
    tower = cast(_VisionTower, model)

    @torch.no_grad()
    def encode(image: ProcessedImage) -> torch.Tensor:
        return tower.encode_image(image.patches, image.plan)

    return EncoderCache(capacity_bytes, encode)


def range_rows(
    model: CausalLM, cache: EncoderCache, seq: Sequence, lo: int, hi: int
) -> list[torch.Tensor]:
    """Rows of the image positions of ``seq`` in ``[lo, hi)``, in position order."""
    image_id = model.image_token_id
    if image_id is None:
        return []
    out = []
    for item in seq.images:  # in prompt order, inside the prompt
        a, b = max(lo, item.offset), min(hi, item.end)
        if a < b:
            out.append(cache.rows(seq.seq_id, item.image)[a - item.offset : b - item.offset])
    first = max(lo, seq.num_prompt_tokens)
    sampled = seq.token_ids[first:hi].count(image_id) if first < hi else 0
    if sampled:
        ids = torch.full((sampled,), image_id, dtype=torch.long, device=model.embed.weight.device)
        out.append(model.embed(ids))
    return out


def image_embeds(
    model: CausalLM, cache: EncoderCache, ranges: list[tuple[Sequence, int, int]]
) -> torch.Tensor | None:
    """``image_embeds`` of a forward over ``ranges`` concatenated (None: no image rows)."""
    rows = [r for seq, lo, hi in ranges for r in range_rows(model, cache, seq, lo, hi)]
    if not rows:
        return None
    dtype = model.embed.weight.dtype
    return torch.cat([r.to(dtype) for r in rows])
