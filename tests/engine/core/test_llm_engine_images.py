"""Image prompts through the engine, both runners, against the dense forward.

The oracle is ``reference.forward`` over the whole sequence under the engine's
admission plan, with ``image_embeds`` the images' ``encode_image`` rows in
prompt order: independent of how the runners cut spans into chunks, replay
rows or decode steps. The model is the session's tiny one in float64 with a
random vision tower (a small ``min_pixels``, so an image is ten tokens).
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from engine.api.errors import RequestError
from engine.api.request import ImageInput, Request
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.reference import GlobalKV, ReplayPlan, forward
from engine.model.deepseek_v41.vision.config import VisionConfig, with_vision
from engine.model.deepseek_v41.vision.image_processor import ProcessedImage, process_image
from kvstore.device.page_hash import SpanKey, chain_hashes
from tests.engine.engine_helpers import (
    Admission,
    W,
    greedy,
    keep_first_writes,
    prompt,
    ratios,
    reference_engine,
    run_to_completion,
    token_stream,
)

IMG = 128_900  # the placeholder id of the tiny vision config
# The release's processor with a small min_pixels: a 126x84 image is 9x6 patches,
# a 3x2 token grid, T = 2 * (3 + 1) + 2 = 10 positions; 84x84 gives 8.
VISION = dataclasses.replace(VisionConfig.tiny(), min_pixels=14 * 14)
# float64 throughout; the reference runner hands its logits over in fp32.
ATOL = {torch.float64: 1e-9, torch.float32: 1e-5}


def image(seed: int, size: tuple[int, int] = (126, 84)) -> ProcessedImage:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, "PNG")
    return process_image(buf.getvalue(), VISION)


@pytest.fixture(scope="module")
def vision_model(engine_model) -> DeepseekV41:
    """The engine tests' tiny weights, a random vision tower whose rows are as large
    as the (scaled) token embeddings, and a random ``bias_vl``: images visibly move
    the logits."""
    config = with_vision(engine_model.config, VISION, token_id=IMG)
    model = DeepseekV41(config)
    model.init_weights(torch.Generator().manual_seed(0))
    model.load_state_dict(engine_model.state_dict(), strict=False)
    model.set_compressed_vocab(engine_model.engram_vocab_map)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in model.blocks:
            block.ffn.gate.bias_vl.copy_(torch.randn(config.n_routed_experts, generator=g))
        for p in (model.image_start, model.image_newline, model.image_end):
            p.copy_(torch.randn(p.shape, generator=g))
        model.aligner.apply(lambda m: m.weight.mul_(30.0) if hasattr(m, "weight") else None)
    return model.double().eval()


# Layout of the two-image prompt (pages of 8): text [0, 10), image A [10, 20),
# text [20, 24), image B [24, 32), text [32, 38). Page 0 is text only, pages 1-2
# hold A (page 1 its head, page 2 its tail), page 3 is B.
A_AT, B_AT, L = 10, 24, 38


def two_image_prompt(a: ProcessedImage, b: ProcessedImage) -> tuple[list[int], list[ImageInput]]:
    ids = prompt(L, 77)
    ids[A_AT : A_AT + a.tokens] = [IMG] * a.tokens
    ids[B_AT : B_AT + b.tokens] = [IMG] * b.tokens
    assert (a.tokens, b.tokens) == (10, 8)
    return ids, [ImageInput(A_AT, a), ImageInput(B_AT, b)]


_ORACLE: dict = {}


def dense_greedy(model, ids: list[int], images: list[ImageInput], n: int, admissions=None):
    """(tokens, logits per step): dense forwards, one plan per admission (default: one
    cold admission), each reading the global KV the earlier ones wrote first (pages are
    written once), with the image rows of the positions it runs."""
    key = (tuple(ids), tuple(i.image.content_hash for i in images), n, repr(admissions))
    if key in _ORACLE:
        return _ORACLE[key]
    with torch.no_grad():
        rows = torch.cat([model.encode_image(i.image.patches, i.image.plan) for i in images])
    where = torch.cat([torch.arange(i.offset, i.end) for i in images])  # row -> position
    seq, tokens, logits, written = list(ids), [], [], GlobalKV()
    for k, adm in enumerate(admissions or [Admission(len(ids), 0, 0, 0)]):
        assert adm.num_tokens == len(seq)
        plan = ReplayPlan.prefill(model.config, len(seq), W, stored_tokens=adm.stored_tokens)
        assert plan.encoder_start == adm.encoder_start
        stored = written.prefix(adm.stored_tokens, ratios(model)) if adm.stored_tokens else None
        embeds = rows[where >= plan.encoder_start]
        end = admissions[k + 1].num_tokens if admissions and k + 1 < len(admissions) else None
        while len(tokens) < n and (end is None or len(seq) < end):
            result = forward(model, torch.tensor(seq), plan, stored, image_embeds=embeds)
            nxt = int(torch.argmax(result.logits[-1]))
            assert nxt != IMG  # a sampled placeholder would need its own row
            tokens.append(nxt)
            logits.append(result.logits[-1])
            seq.append(nxt)
            keep_first_writes(written, result.global_kv)
    _ORACLE[key] = tokens, logits
    return tokens, logits


def assert_answer(runner, rid: str, outputs, expected, index: int = 0) -> None:
    tokens, logits = expected
    assert token_stream(outputs[rid], index) == tokens
    got = runner.logits[rid, index]
    assert len(got) == len(logits)
    for step, (a, b) in enumerate(zip(got, logits, strict=True)):
        diff = (a.double() - b).abs().max().item()
        assert diff < ATOL[a.dtype], f"{rid}: step {step} logits differ by {diff}"


RUNNERS = ["reference", "paged"]


@pytest.mark.parametrize("runner_name", RUNNERS)
@pytest.mark.parametrize("chunk", [512, 7])
def test_an_image_prompt_is_the_dense_forward(vision_model, runner_name, chunk):
    """Chunks of 7 cut both spans (at 14 and 28); the vision tower runs once per image."""
    a, b = image(1), image(2, (84, 84))
    ids, images = two_image_prompt(a, b)
    engine, runner = reference_engine(
        vision_model, runner=runner_name, prefill_chunk_tokens=chunk, max_num_batched_tokens=512
    )
    engine.add_request(Request("r", ids, greedy(3), images=images))
    outputs = run_to_completion(engine)
    assert_answer(runner, "r", outputs, dense_greedy(vision_model, ids, images, 3))
    assert runner.inner.encoder_cache.encodes == 2
    # The images matter: the same ids as plain tokens answer otherwise.
    plain = forward(vision_model, torch.tensor(ids), ReplayPlan.prefill(vision_model.config, L, W))
    assert (plain.logits[-1] - runner.logits["r", 0][0]).abs().max() > 1e-2
    assert outputs["r"][-1].usage.prompt_tokens == L  # placeholders are prompt tokens


@pytest.mark.parametrize("runner_name", RUNNERS)
def test_same_image_hits_a_different_one_does_not(vision_model, runner_name):
    a, b = image(1), image(2, (84, 84))
    ids, images = two_image_prompt(a, b)
    engine, runner = reference_engine(vision_model, runner=runner_name)
    engine.add_request(Request("first", ids, greedy(2), images=images))
    run_to_completion(engine)
    # The same pixels decoded again (a new object, the same content hash).
    again = [ImageInput(A_AT, image(1)), ImageInput(B_AT, image(2, (84, 84)))]
    engine.add_request(Request("same", ids, greedy(2), images=again))
    outputs = run_to_completion(engine)
    # The hit ends after span B, at the cap of (38 - 1) // 8 pages.
    assert outputs["same"][-1].usage.prompt_cache_hit_tokens == 32
    assert_answer(runner, "same", outputs, dense_greedy(vision_model, ids, images, 2))
    # Image A swapped for another of its size: page 0 (text) hits, page 1 (A's head) not.
    other = [ImageInput(A_AT, image(3)), ImageInput(B_AT, b)]
    engine.add_request(Request("other", ids, greedy(2), images=other))
    outputs = run_to_completion(engine)
    assert outputs["other"][-1].usage.prompt_cache_hit_tokens == 8
    assert_answer(runner, "other", outputs, dense_greedy(vision_model, ids, other, 2))
    same_logits = dense_greedy(vision_model, ids, images, 2)[1][0]
    assert (runner.logits["other", 0][0] - same_logits).abs().max() > 1e-3


@pytest.mark.parametrize("runner_name", RUNNERS)
def test_a_hit_ending_inside_a_span(vision_model, runner_name):
    """A first prompt of 22 tokens commits pages 0-1: the second's hit of 16 ends
    inside span A [10, 20); its remaining rows (and the replay below 16) are A's."""
    a, b = image(1), image(2, (84, 84))
    ids, images = two_image_prompt(a, b)
    engine, runner = reference_engine(vision_model, runner=runner_name)
    engine.add_request(Request("head", ids[:22], greedy(1), images=images[:1]))
    run_to_completion(engine)
    engine.add_request(Request("full", ids, greedy(2), images=images))
    outputs = run_to_completion(engine)
    assert outputs["full"][-1].usage.prompt_cache_hit_tokens == 16
    (admission,) = runner.admissions["full", 0]
    assert admission.stored_tokens == 16 and admission.encoder_start < A_AT + 10
    assert_answer(runner, "full", outputs, dense_greedy(vision_model, ids, images, 2))
    # A was encoded for "head" and stayed cached; B once for "full".
    assert runner.inner.encoder_cache.encodes == 2


@pytest.mark.parametrize("runner_name", RUNNERS)
def test_preemption_and_two_choices_keep_the_images(vision_model, runner_name):
    """7 pages of 8 (as the text preemption test): "a" (30 text tokens) and "b" (an
    image prompt of 20) fit at admission; "a" growing preempts "b", which resumes
    from its committed pages, the replay reading A's rows again from the cache.
    "c" asks two choices of another image prompt: both are its greedy stream."""
    a = image(1)
    b_ids = prompt(20, 8)
    b_ids[4:14] = [IMG] * 10
    b_images = [ImageInput(4, a)]
    engine, runner = reference_engine(vision_model, runner=runner_name, num_pages=7)
    engine.add_request(Request("a", prompt(30, 7), greedy(4)))
    engine.add_request(Request("b", b_ids, greedy(5), images=b_images))
    outputs = run_to_completion(engine)
    assert engine.scheduler.num_preemptions == 1
    assert outputs["b"][-1].metrics.num_preemptions == 1
    assert [x.stored_tokens for x in runner.admissions["b", 0]] == [0, 16]
    # The resume runs the plan of its own admission over the KV the first one wrote.
    admissions = runner.admissions["b", 0]
    assert_answer(runner, "b", outputs, dense_greedy(vision_model, b_ids, b_images, 5, admissions))
    assert runner.inner.encoder_cache.encodes == 1

    c_ids, c_images = list(b_ids), [ImageInput(4, image(5))]
    engine.add_request(Request("c", c_ids, greedy(2, n=2), images=c_images))
    outputs = run_to_completion(engine)
    expected = dense_greedy(vision_model, c_ids, c_images, 2)
    for index in (0, 1):
        assert_answer(runner, "c", outputs, expected, index)
    assert runner.inner.encoder_cache.encodes == 2  # one more image, shared by both choices


@pytest.mark.parametrize("runner_name", RUNNERS)
def test_same_image_hits_the_ssd_tier_after_a_restart(vision_model, runner_name, tmp_path):
    a, b = image(1), image(2, (84, 84))
    ids, images = two_image_prompt(a, b)
    engine, _ = reference_engine(vision_model, runner=runner_name, kv_dir=tmp_path)
    engine.add_request(Request("first", ids, greedy(2), images=images))
    run_to_completion(engine)
    engine.close()  # flushes the write-behind queue

    engine, runner = reference_engine(vision_model, runner=runner_name, kv_dir=tmp_path)
    again = [ImageInput(A_AT, image(1)), ImageInput(B_AT, image(2, (84, 84)))]
    engine.add_request(Request("second", ids, greedy(2), images=again))
    other = [ImageInput(A_AT, a), ImageInput(B_AT, image(4, (84, 84)))]
    engine.add_request(Request("other", ids, greedy(2), images=other))
    outputs = run_to_completion(engine)
    engine.close()
    usage = outputs["second"][-1].usage
    assert (usage.prompt_ssd_hit_tokens, usage.prompt_device_hit_tokens) == (32, 0)
    assert_answer(runner, "second", outputs, dense_greedy(vision_model, ids, images, 2))
    # B differs: pages 0-2 hit (from SSD or from "second"'s restore), page 3 not.
    assert outputs["other"][-1].usage.prompt_cache_hit_tokens == 24


def test_images_are_refused_by_a_text_model(engine_model):
    engine, _ = reference_engine(engine_model)
    ids = prompt(20, 1)
    ids[2:12] = [IMG] * 10
    with pytest.raises(RequestError, match="this model has no vision tower") as err:
        engine.add_request(Request("r", ids, greedy(1), images=[ImageInput(2, image(1))]))
    assert err.value.param == "images"


def _bad(ids, images):
    return Request("r", ids, greedy(1), images=images)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("outside", "lies outside the prompt"),
        ("overlap", "in prompt order, not overlapping"),
        ("order", "in prompt order, not overlapping"),
        ("not-placeholder", "must hold the image placeholder id"),
        ("stray-placeholder", "appears outside the images' spans"),
        ("patches", "its plan needs"),
    ],
)
def test_bad_spans_are_refused(vision_model, case, message):
    engine, _ = reference_engine(vision_model)
    a = image(1)
    ids = prompt(40, 2)
    ids[5:15] = [IMG] * 10
    ids[20:30] = [IMG] * 10
    images = [ImageInput(5, a), ImageInput(20, a)]
    if case == "outside":
        images = [ImageInput(35, a)]
        ids = prompt(40, 2)
        ids[35:] = [IMG] * 5
    elif case == "overlap":
        images = [ImageInput(5, a), ImageInput(10, a)]
    elif case == "order":
        images = images[::-1]
    elif case == "not-placeholder":
        ids[14] = 7
    elif case == "stray-placeholder":
        ids[33] = IMG
    elif case == "patches":
        bad = ProcessedImage(a.plan, a.patches[:-1], a.content_hash)
        images = [ImageInput(5, bad), ImageInput(20, a)]
    with pytest.raises(RequestError, match=message):
        engine.add_request(_bad(ids, images))
    # The good request goes through.
    good = prompt(40, 2)
    good[5:15] = [IMG] * 10
    engine.add_request(_bad(good, [ImageInput(5, a)]))


def test_a_prefill_only_hand_over_is_keyed_as_the_decode_side_looks_it_up(vision_model):
    """The prefill worker's published chain is the page-hash chain over the images (the
    one ``chain_hashes``); a decode-side request with the same image hits every page."""
    a, b = image(1), image(2, (84, 84))
    ids, images = two_image_prompt(a, b)
    engine, runner = reference_engine(vision_model)
    engine.add_request(Request("p", ids, images=images, prefill_only=True))
    published = run_to_completion(engine)["p"][-1].published_pages
    spans = [SpanKey(i.offset, i.image.tokens, i.image.content_hash) for i in images]
    assert published == chain_hashes(ids, b"", 8, spans=spans)
    assert len(published) == L // 8 and published != chain_hashes(ids, b"", 8)
    engine.add_request(Request("d", ids, greedy(2), images=images))
    outputs = run_to_completion(engine)
    assert outputs["d"][-1].usage.prompt_cache_hit_tokens == 32
    assert_answer(runner, "d", outputs, dense_greedy(vision_model, ids, images, 2))
