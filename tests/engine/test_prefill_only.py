"""Prefill-only requests: the engine half of disaggregated serving.

A prefill worker runs the encoder path over a prompt's full pages and
publishes them to the SSD tier; a decode worker on the same directory
restores them like any prefix hit. The oracle of the decode side is the dense
reference restored from pages written by a forward over those full pages
(docs/design/disaggregation.md).
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from engine_helpers import (
    W,
    assert_matches,
    fake_engine,
    greedy,
    prompt,
    ratios,
    reference_engine,
    run_to_completion,
    token_stream,
)

from engine.api.async_engine import AsyncEngine
from engine.api.errors import RequestError
from engine.api.request import Request
from engine.config import EngineConfig
from engine.model.deepseek_v41.reference import ReplayPlan, forward

PT = 8


def _small(n: int, seed: int) -> list[int]:
    """Token ids inside the fake engine's 64-token vocabulary."""
    return [3 + t % 60 for t in prompt(n, seed)]


def _prefill_only(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, greedy(1), prefill_only=True)


def test_prefill_only_then_decode_equals_a_restore_of_its_pages(flavour, tmp_path):
    model, oracle = flavour.model, flavour.oracle
    tokens = prompt(45, 7)
    # The decode worker starts first: it finds the pages by lookup, not by a start-up scan.
    decode, decode_runner = reference_engine(model, runner=flavour.runner, kv_dir=tmp_path)
    prefill, prefill_runner = reference_engine(model, runner=flavour.runner, kv_dir=tmp_path)

    prefill.add_request(_prefill_only("p", tokens))
    (out,) = run_to_completion(prefill)["p"]
    assert out.finished and out.outputs[0].token_ids == [] and not prefill_runner.logits
    assert len(out.published_pages) == 45 // PT
    assert prefill.kv.wait_published(out.published_pages) == 5
    # The encoder path only: no row reaches the decoder.
    (admission,) = prefill_runner.admissions["p", 0]
    assert (admission.num_tokens, admission.decoder_start) == (40, 40)
    prefill.close()

    decode.add_request(Request("d", tokens, greedy(3)))
    outputs = run_to_completion(decode)
    decode.close()
    usage = outputs["d"][-1].usage
    assert (usage.prompt_ssd_hit_tokens, usage.prompt_device_hit_tokens) == (40, 0)
    assert decode.kv.stats().ssd.discovered_files == 5
    # Oracle: pages hold what a forward over the 40 handed-over tokens wrote.
    written = forward(model, torch.tensor(tokens[:40]), ReplayPlan.prefill(model.config, 40, W))
    stored = written.global_kv.prefix(40, ratios(model))
    ref = oracle(tokens, 3, stored_tokens=40, stored=stored)
    assert_matches(decode_runner, "d", outputs, ref.tokens, ref.logits)
    (admission,) = decode_runner.admissions["d", 0]
    e0 = ReplayPlan.prefill(model.config, len(tokens), W, stored_tokens=40).encoder_start
    assert (admission.stored_tokens, admission.encoder_start) == (40, e0)


def test_a_fully_cached_prompt_runs_no_row():
    engine, _ = fake_engine()
    tokens = _small(24, 3)
    engine.add_request(_prefill_only("a", tokens))
    first = run_to_completion(engine)["a"][-1]
    rows_after_first = engine.counters.prefill_rows
    assert rows_after_first == 24 and first.usage.prompt_cache_hit_tokens == 0

    engine.add_request(_prefill_only("b", tokens))
    second = run_to_completion(engine)["b"][-1]
    assert second.finished and second.usage.prompt_cache_hit_tokens == 24
    assert engine.counters.prefill_rows == rows_after_first  # nothing replayed
    assert second.usage.replay_tokens == 0
    assert second.published_pages == first.published_pages
    assert engine.kv.stats().device_pages_in_use == 0


def test_a_prompt_shorter_than_a_page_hands_over_nothing():
    engine, _ = fake_engine()
    engine.add_request(_prefill_only("a", _small(PT - 1, 4)))
    outputs = run_to_completion(engine)
    (out,) = outputs["a"]
    assert out.finished and out.published_pages == []
    assert engine.counters.steps == 0 and engine.counters.prefill_rows == 0


def test_only_full_pages_run_and_the_tail_is_left_to_decode():
    engine, _ = fake_engine()
    engine.add_request(_prefill_only("a", _small(3 * PT + 5, 5)))
    engine.add_request(Request("b", _small(20, 6), greedy(4)))  # a normal neighbour
    outputs = run_to_completion(engine)
    assert engine.counters.prefill_rows == 3 * PT + 20
    assert len(outputs["a"][-1].published_pages) == 3
    assert len(token_stream(outputs["b"])) == 4
    assert engine.kv.stats().device_pages_in_use == 0


def test_async_prefill_without_an_ssd_tier_hands_over_nothing():
    engine, _ = fake_engine()
    async_engine = AsyncEngine(EngineConfig(runner="reference"), engine=engine)
    try:
        result = asyncio.run(async_engine.prefill(_prefill_only("a", _small(20, 8))))
    finally:
        async_engine.shutdown()
    # No SSD tier: nothing can be handed over.
    assert (result.prompt_tokens, result.published_pages, result.published_bytes) == (20, 0, 0)


def test_async_prefill_reports_published_bytes(engine_model, tmp_path):
    engine, _ = reference_engine(engine_model, kv_dir=tmp_path)
    async_engine = AsyncEngine(EngineConfig(runner="reference"), engine=engine)
    try:
        result = asyncio.run(async_engine.prefill(_prefill_only("a", prompt(20, 9))))
        files = sorted((tmp_path).rglob("*.kvp"))
    finally:
        async_engine.shutdown()
    assert result.published_pages == 2 and result.page_tokens == PT
    layout = engine.kv.layout
    assert result.page_file_bytes > layout.page_bytes
    assert [f.stat().st_size for f in files] == [result.page_file_bytes] * 2
    assert result.published_bytes == 2 * result.page_file_bytes


def test_an_encoder_only_model_writes_the_same_pages(engine_model64):
    """A prefill worker loads layers [0, B] only; its pages equal the full model's."""
    encoder = copy.deepcopy(engine_model64)
    encoder.drop_decoder_layers()
    tokens = prompt(45, 11)
    pages = []
    for model in (engine_model64, encoder):
        engine, runner = reference_engine(model, runner="paged")
        engine.add_request(_prefill_only("p", tokens))
        (out,) = run_to_completion(engine)["p"]
        ids = [engine.kv.pool.lookup(h) for h in out.published_pages]
        pages.append(runner.inner.device_pages.pages[torch.tensor(ids)])
    assert len(ids) == 5 and torch.equal(pages[0], pages[1])
    with pytest.raises(RequestError, match="prefill worker"):
        engine.add_request(Request("n", tokens, greedy(1)))
