"""Image prompts under parallel serving: 2 worker ranks (gloo, loopback), TP and DP.

Oracle: the same checkpoint (a tiny model with a small vision tower) in one
process, float64, the same requests. The vision tower is replicated: each rank
that runs a sequence's rows encodes its images from the patches the core sent
with the sequence's first state (docs/design/images.md). Two requests with the
same image, one with another of its size, chunked prefills that cut the spans:
greedy tokens equal the single process's, and the second same-image request hits
the pages over the span on whichever rank it is placed.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from engine.api.request import ImageInput, Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.loader.builder import build_engine
from engine.loader.checkpoint_writer import save_checkpoint, write_tiny_tokenizer
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.vision.config import VisionConfig, with_vision
from engine.model.deepseek_v41.vision.image_processor import process_image
from kvstore.device.layout import kv_layout

pytestmark = pytest.mark.slow

IMG = 128_900
VISION = dataclasses.replace(VisionConfig.tiny(), min_pixels=14 * 14)
PAGE_TOKENS = 8


def _image(seed: int):
    pixels = np.random.default_rng(seed).integers(0, 256, (84, 126, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return process_image(buf.getvalue(), VISION)  # 10 positions


def _requests() -> list[Request]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 129000, (30,), generator=g).tolist()
    ids[10:20] = [IMG] * 10
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return [
        Request(rid, list(ids), greedy, images=[ImageInput(10, _image(seed))])
        for rid, seed in (("a", 1), ("same", 1), ("other", 2))
    ]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = with_vision(ModelConfig.tiny(), VISION, token_id=IMG)
    model = DeepseekV41(config)
    model.init_weights(torch.Generator().manual_seed(1234))
    with torch.no_grad():
        model.embed.weight.mul_(10.0)
        for p in (model.image_start, model.image_newline, model.image_end):
            p.normal_(generator=torch.Generator().manual_seed(7))
    out = save_checkpoint(model, config, tmp_path_factory.mktemp("tiny-vision-par"))
    write_tiny_tokenizer(out, config)
    return out


def _config(pages: int = 64, **parallel) -> EngineConfig:
    c = ModelConfig.tiny()
    layout = kv_layout(c.kv_source_layer_ids, c.compress_ratios, PAGE_TOKENS, "fp4")
    return EngineConfig(
        dtype="float64",
        quantization="none",
        page_tokens=PAGE_TOKENS,
        prefill_chunk_tokens=7,  # cuts the span [10, 20) at 14
        max_num_batched_tokens=64,
        max_num_seqs=4,
        kv_cache_bytes=pages * layout.page_bytes,
        worker_threads=1,
        worker_timeout_s=60.0,
        **parallel,
    )


def _serve(engine) -> tuple[dict[str, list[int]], dict[str, int]]:
    tokens: dict[str, list[int]] = {}
    hits: dict[str, int] = {}
    for request in _requests():  # one after the other: "same" finds "a"'s pages
        engine.add_request(request)
        while engine.has_unfinished_requests():
            for out in engine.step():
                for c in out.outputs:
                    tokens.setdefault(out.request_id, []).extend(c.token_ids)
                if out.finished:
                    hits[out.request_id] = out.usage.prompt_cache_hit_tokens
    return tokens, hits


@pytest.fixture(scope="module")
def single(checkpoint):
    torch.set_num_threads(1)
    engine = build_engine(_config(), checkpoint)
    try:
        return _serve(engine)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "flags", [{"tensor_parallel_size": 2}, {"data_parallel_size": 2}], ids=["tp2", "dp2"]
)
def test_two_ranks_answer_an_image_as_one_process(checkpoint, single, flags):
    want, want_hits = single
    assert want_hits == {"a": 0, "same": 24, "other": 8}
    assert want["same"] == want["a"]
    pages = 64 // flags.get("data_parallel_size", 1)  # DP: each rank its own pool
    engine = build_engine(_config(pages, **flags), checkpoint)
    try:
        tokens, hits = _serve(engine)
    finally:
        engine.close()
    assert tokens == want
    assert hits == want_hits
