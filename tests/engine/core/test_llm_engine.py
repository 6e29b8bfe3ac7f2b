"""LLMEngine against the dense reference, and its bookkeeping against hand counts.

Model tests run the engine over ``ReferenceRunner`` (real KV bytes in pages)
and compare every greedy token and every step's logits with
``reference_generate`` under the same semantics; restore cases feed the
oracle the global KV of the earlier run's prefix.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import (
    ATOL,
    W,
    assert_matches,
    assert_same_answer,
    fake_engine,
    greedy,
    keep_first_writes,
    prompt,
    ratios,
    reference_engine,
    run_to_completion,
    token_stream,
)

from engine.api.errors import RequestError
from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.reference import (
    GlobalKV,
    KVPrecision,
    ReplayPlan,
    forward,
)
from engine.runner.reference_runner import requantize_main_kv
from kernels.kv_formats import dequantize_main_kv, fake_quant_main_kv, quantize_main_kv

PT = 8  # page tokens in these tests


# ----------------------------------------------------------------- vs reference


def test_one_request_matches_reference(flavour):
    engine_model, oracle = flavour.model, flavour.oracle
    engine, runner = reference_engine(engine_model, runner=flavour.runner)
    tokens = prompt(37, 1)
    engine.add_request(Request("a", tokens, greedy(4)))
    outputs = run_to_completion(engine)
    ref = oracle(tokens, 4)
    assert len(set(ref.tokens)) > 1, "the test model should not repeat one token"
    assert_matches(runner, "a", outputs, ref.tokens, ref.logits)
    (last,) = [o for o in outputs["a"] if o.finished]
    assert last.outputs[-1].finish_reason == "length"
    assert last.usage.prompt_tokens == 37 and last.usage.completion_tokens == 4
    assert last.usage.prompt_cache_hit_tokens == 0 and last.usage.prompt_cache_miss_tokens == 37
    assert engine.kv.stats().device_pages_in_use == 0


LENGTHS = [10, 17, 23, 31, 38, 45, 52, 60]


def test_eight_requests_in_one_batch(flavour):
    engine_model, oracle = flavour.model, flavour.oracle
    engine, runner = reference_engine(engine_model, runner=flavour.runner)
    prompts = {f"r{i}": prompt(n, 100 + i) for i, n in enumerate(LENGTHS)}
    for rid, tokens in prompts.items():
        engine.add_request(Request(rid, tokens, greedy(2)))
    outputs = run_to_completion(engine)
    assert runner.max_prefills_per_step == 8  # all admitted in the first step
    for rid, tokens in prompts.items():
        ref = oracle(tokens, 2)
        assert_matches(runner, rid, outputs, ref.tokens, ref.logits)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill(flavour, chunk):
    engine_model, oracle = flavour.model, flavour.oracle
    # Two of the eight prompts: the short one decodes while the long one is
    # still prefilling in chunks, so steps mix decodes and chunks.
    engine, runner = reference_engine(
        engine_model, runner=flavour.runner, prefill_chunk_tokens=chunk
    )
    prompts = {"long": prompt(LENGTHS[5], 105), "short": prompt(LENGTHS[1], 101)}
    for rid, tokens in prompts.items():
        engine.add_request(Request(rid, tokens, greedy(2)))
    outputs = run_to_completion(engine)
    for rid, tokens in prompts.items():
        ref = oracle(tokens, 2)
        assert_matches(runner, rid, outputs, ref.tokens, ref.logits)
    assert engine.counters.prefill_rows == sum(map(len, prompts.values()))


def expected_with_admissions(model, tokens: list[int], admissions, max_tokens: int):
    """Greedy stream composed from dense forwards, one plan per admission.

    Admission ``i`` starts from the tokens generated so far and reads the
    global KV of ``[0, H_i)`` that the previous admissions wrote. Each entry is
    kept from the first forward that completed it, as pages are written once.
    """
    tokens = list(tokens)
    out: list[int] = []
    logits: list[torch.Tensor] = []
    written = GlobalKV()
    for i, adm in enumerate(admissions):
        assert adm.num_tokens == len(tokens)
        plan = ReplayPlan.prefill(model.config, len(tokens), W, stored_tokens=adm.stored_tokens)
        # The engine ran the plan the prefill rule gives.
        assert (plan.stored_tokens, plan.encoder_start, plan.decoder_start(model.config)) == (
            adm.stored_tokens,
            adm.encoder_start,
            adm.decoder_start,
        )
        stored = written.prefix(adm.stored_tokens, ratios(model)) if adm.stored_tokens else None
        end = admissions[i + 1].num_tokens if i + 1 < len(admissions) else None
        while len(out) < max_tokens and (end is None or len(tokens) < end):
            result = forward(model, torch.tensor(tokens), plan, stored)
            logits.append(result.logits[-1])
            tokens.append(int(result.logits[-1].argmax()))
            out.append(tokens[-1])
            keep_first_writes(written, result.global_kv)
    return out, logits


def test_preemption_and_resume(flavour):
    engine_model = flavour.model
    # 7 pages of 8: "a" (30 + 4 tokens) and "b" (20 + 5) fit at admission (4 + 3
    # pages); when "a" reaches 33 tokens it needs a fifth page and "b", the
    # newer, is preempted with 23 tokens, two full pages committed. It resumes
    # after "a" finishes, restoring 16 tokens from the device tier.
    engine, runner = reference_engine(engine_model, runner=flavour.runner, num_pages=7)
    prompts = {"a": prompt(30, 7), "b": prompt(20, 8)}
    engine.add_request(Request("a", prompts["a"], greedy(4)))
    engine.add_request(Request("b", prompts["b"], greedy(5)))
    outputs = run_to_completion(engine)
    assert engine.scheduler.num_preemptions == 1
    b_admissions = runner.admissions["b", 0]
    assert len(b_admissions) == 2 and b_admissions[1].stored_tokens == 16
    assert b_admissions[1].num_tokens == 23
    for rid, n in (("a", 4), ("b", 5)):
        exp_tokens, exp_logits = expected_with_admissions(
            engine_model, prompts[rid], runner.admissions[rid, 0], n
        )
        assert_matches(runner, rid, outputs, exp_tokens, exp_logits)
    final = outputs["b"][-1]
    assert final.metrics.num_preemptions == 1
    assert final.usage.prompt_cache_hit_tokens == 0  # measured at the first admission
    assert final.usage.replay_tokens == 16
    stats = engine.kv.stats()
    assert stats.device_pages_in_use == 0
    assert stats.device_pages_free + stats.device_pages_cached == 7


def restored_reference(oracle, model, tokens: list[int], n: int, hit: int):
    """The stream after a hit of ``hit`` tokens on pages an earlier request wrote.

    Pages hold what was written when each entry was first complete: here the
    earlier request's prefill. (A longer forward may round an entry's last bit
    differently, and FP4 can then round it to a different code.)
    """
    written = forward(model, torch.tensor(tokens), ReplayPlan.prefill(model.config, len(tokens), W))
    stored = written.global_kv.prefix(hit, ratios(model))
    return oracle(tokens, n, stored_tokens=hit, stored=stored), oracle(tokens, n)


def test_restore_from_the_device_tier(flavour):
    engine_model, oracle = flavour.model, flavour.oracle
    engine, runner = reference_engine(engine_model, runner=flavour.runner)
    tokens = prompt(45, 105)
    engine.add_request(Request("first", tokens, greedy(2)))
    run_to_completion(engine)
    engine.add_request(Request("second", tokens, greedy(2)))
    outputs = run_to_completion(engine)
    # 46 rows written by the first run: 5 full pages; the hit is capped at (45 - 1) // 8 pages.
    ref, first = restored_reference(oracle, engine_model, tokens, 2, 40)
    assert_matches(runner, "second", outputs, ref.tokens, ref.logits)
    assert runner.logits["first", 0][0].sub(first.logits[0]).abs().max() < ATOL
    # A cache hit never changes the answer: the restored stream is the cold one.
    assert_same_answer(runner, "second", outputs, first)
    usage = outputs["second"][-1].usage
    assert (usage.prompt_cache_hit_tokens, usage.prompt_device_hit_tokens) == (40, 40)
    e0 = ReplayPlan.prefill(engine_model.config, 45, W, stored_tokens=40).encoder_start
    assert usage.prompt_cache_miss_tokens == 5 and usage.replay_tokens == 40 - e0
    (admission,) = runner.admissions["second", 0]
    assert (admission.stored_tokens, admission.encoder_start) == (40, e0)


@pytest.mark.parametrize(("prefix", "extra"), [(24, 3), (40, 30), (64, 50)])
def test_a_cache_hit_equals_the_cold_run(flavour, prefix, extra):
    """H = 24, 40, 64 (page multiples); suffixes of 3 (below the window of 16), 30 and
    50 tokens (above it): the restored stream is the cold run's."""
    engine, runner = reference_engine(flavour.model, runner=flavour.runner)
    tokens = prompt(prefix + extra, 300 + prefix)
    engine.add_request(Request("first", tokens[:prefix], greedy(1)))  # caches the prefix
    run_to_completion(engine)
    engine.add_request(Request("second", tokens, greedy(3)))
    outputs = run_to_completion(engine)
    assert outputs["second"][-1].usage.prompt_cache_hit_tokens == prefix
    assert_same_answer(runner, "second", outputs, flavour.oracle(tokens, 3))


def test_restore_from_ssd_after_restart(flavour, tmp_path):
    engine_model, oracle = flavour.model, flavour.oracle
    tokens = prompt(45, 105)
    engine, _ = reference_engine(engine_model, runner=flavour.runner, kv_dir=tmp_path)
    engine.add_request(Request("first", tokens, greedy(2)))
    run_to_completion(engine)
    engine.close()  # flushes the write-behind queue

    engine, runner = reference_engine(
        engine_model, runner=flavour.runner, kv_dir=tmp_path
    )  # a fresh device tier
    engine.add_request(Request("second", tokens, greedy(2)))
    outputs = run_to_completion(engine)
    engine.close()
    ref, cold = restored_reference(oracle, engine_model, tokens, 2, 40)
    assert_matches(runner, "second", outputs, ref.tokens, ref.logits)
    assert_same_answer(runner, "second", outputs, cold)
    usage = outputs["second"][-1].usage
    assert (usage.prompt_ssd_hit_tokens, usage.prompt_device_hit_tokens) == (40, 0)


def test_full_depth_equals_the_exact_reference(flavour):
    engine_model, oracle = flavour.model, flavour.oracle
    engine, runner = reference_engine(engine_model, runner=flavour.runner, enable_ced=False)
    tokens = prompt(31, 3)
    engine.add_request(Request("a", tokens, greedy(2)))
    outputs = run_to_completion(engine)
    ref = oracle(tokens, 2, ced=False)
    assert ref.plan == ReplayPlan.exact(engine_model.config)
    assert_matches(runner, "a", outputs, ref.tokens, ref.logits)


def test_bf16_global_kv_through_pages(flavour):
    engine_model, oracle = flavour.model, flavour.oracle
    engine, runner = reference_engine(engine_model, runner=flavour.runner, kv_dtype="bf16")
    tokens = prompt(26, 4)
    bf16 = KVPrecision(global_kv="bf16")
    engine.add_request(Request("first", tokens, greedy(2)))
    run_to_completion(engine)
    engine.add_request(Request("second", tokens, greedy(2)))
    outputs = run_to_completion(engine)
    # Pages below 24 depend on the prompt only: one prefill gives their KV.
    plan = ReplayPlan.prefill(engine_model.config, 26, W)
    first = forward(engine_model, torch.tensor(tokens), plan, precision=bf16)
    stored = first.global_kv.prefix(24, ratios(engine_model))
    ref = oracle(tokens, 2, precision=bf16, stored_tokens=24, stored=stored)
    assert outputs["second"][-1].usage.prompt_cache_hit_tokens == 24
    assert_matches(runner, "second", outputs, ref.tokens, ref.logits)


# ----------------------------------------------------------------- bookkeeping


def test_abort_frees_pages_at_once_and_reports_abort():
    engine, runner = fake_engine(num_pages=16)
    engine.add_request(Request("a", list(range(3, 30)), greedy(50)))
    engine.add_request(Request("b", list(range(3, 12)), greedy(50)))
    for _ in range(3):
        engine.step()
    assert engine.kv.stats().device_pages_in_use == 4 + 2  # rows up to 29 and 11
    assert engine.abort("a")
    assert engine.kv.stats().device_pages_in_use == 2
    assert runner.released == [0]
    (out,) = [o for o in engine.step() if o.request_id == "a"]
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.abort("a")  # already gone


def test_a_thousand_short_requests_leave_the_pool_as_it_started():
    rng = random.Random(0)
    engine, _ = fake_engine(num_pages=8, page_tokens=4, max_num_seqs=8)
    start = engine.kv.stats()
    # Many prompts end on a page boundary, so their first decode needs a new
    # page while the pool is full: preemptions happen.
    lengths = [rng.choice([1, 3, 4, 4, 5, 8, 8, 11, 12]) for _ in range(40)]
    prompts = [[rng.randrange(3, 60) for _ in range(n)] for n in lengths]
    finished: dict[str, int] = {}
    live: list[str] = []
    aborted = set()
    pending = [f"r{i}" for i in range(1000)]
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 6)):
            if pending:
                rid = pending.pop(0)
                params = greedy(rng.randrange(1, 3), n=rng.choice([1, 1, 2]))
                engine.add_request(Request(rid, list(rng.choice(prompts)), params, cache_salt="t"))
                live.append(rid)
        if rng.random() < 0.1 and live:
            rid = live.pop(rng.randrange(len(live)))
            assert engine.abort(rid)
            aborted.add(rid)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = finished.get(out.request_id, 0) + 1
                if out.request_id in live:
                    live.remove(out.request_id)
    assert len(finished) == 1000 and set(finished.values()) == {1}
    assert engine.scheduler.num_preemptions > 0 and aborted
    stats = engine.kv.stats()
    assert stats.lookups > 1000 and stats.device_hit_tokens > 0  # shared prompts did hit
    assert stats.device_pages_in_use == start.device_pages_in_use == 0
    assert stats.device_pages_free + stats.device_pages_cached == stats.device_pages_total == 8
    assert all(r == 0 for r in engine.kv.pool.refcounts)
    assert not engine.scheduler.running and not engine.scheduler.waiting


def scripted(script: list[int]):
    """Next token = script[number of output tokens so far] (then 7 forever)."""

    def next_token(seq) -> int:
        k = seq.num_output_tokens
        return script[k] if k < len(script) else 7

    return next_token


def finish_of(outputs) -> tuple[list[int], str | None, int | str | None]:
    last = outputs[-1].outputs[-1]
    return token_stream(outputs), last.finish_reason, last.stop_reason


def test_stop_tokens_and_lengths():
    engine, _ = fake_engine(next_token=scripted([5, 6, 1, 8]))
    params = {
        "eos": SamplingParams(temperature=0, max_tokens=10),
        "ignore": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
        "stop_id": SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[6]),
        "len": SamplingParams(temperature=0, max_tokens=2),
    }
    for rid, p in params.items():
        engine.add_request(Request(rid, [3, 4, 5], p))
    out = run_to_completion(engine)
    assert finish_of(out["eos"]) == ([5, 6, 1], "stop", 1)
    assert finish_of(out["ignore"]) == ([5, 6, 1, 8], "length", None)
    assert finish_of(out["stop_id"]) == ([5, 6], "stop", 6)
    assert finish_of(out["len"]) == ([5, 6], "length", None)


def test_max_model_len_ends_with_length():
    engine, _ = fake_engine(max_model_len=12)
    engine.add_request(Request("a", list(range(3, 13)), greedy(100)))  # 10 tokens
    assert finish_of(run_to_completion(engine)["a"])[1:] == ("length", None)
    with pytest.raises(RequestError, match="max_model_len"):
        engine.validate(Request("b", list(range(3, 15)), greedy(1)))


def test_stop_string_across_tokens_with_text_deltas():
    tokenizer = load_tokenizer()
    ids = tokenizer.encode("Hello world, good bye", add_special_tokens=False).ids
    engine, _ = fake_engine(vocab_size=129280, next_token=scripted(ids), tokenizer=tokenizer)
    engine.add_request(Request("a", [0, 100], greedy(20, stop=["d, go"])))
    outputs = run_to_completion(engine)["a"]
    text = "".join(c.text for o in outputs for c in o.outputs)
    assert text == "Hello worl"
    assert outputs[-1].outputs[0].finish_reason == "stop"
    assert outputs[-1].outputs[0].stop_reason == "d, go"


def test_n_choices_logprobs_and_usage():
    engine, _ = fake_engine(vocab_size=32, next_token=scripted([9, 10, 11]))
    engine.add_request(Request("a", [3, 4, 5, 6], greedy(3, n=2, logprobs=2)))
    outputs = run_to_completion(engine)["a"]
    for index in (0, 1):
        assert token_stream(outputs, index) == [9, 10, 11]
    first = outputs[0].outputs[0]
    (lp,) = first.logprobs
    # One-hot logits of 10 over 32 tokens: logprob of the best = -log(1 + 31 e^-10).
    best = -torch.log1p(31 * torch.exp(torch.tensor(-10.0))).item()
    assert lp.token_id == 9 and lp.logprob == pytest.approx(best, abs=1e-6)
    assert lp.top_logprobs[0][0] == 9 and len(lp.top_logprobs) == 2
    usage = outputs[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 6)
    assert outputs[-1].finished and len([o for o in outputs if o.finished]) == 1


def test_requantised_main_records_decode_to_the_reference_values():
    # Tiles whose amax / 6 falls among E4M3 subnormals lose their scale on a
    # second quantiser trip; the reference runner's records must not.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 512, generator=g) * torch.logspace(-3, 1, 512)[:, None]
    y = fake_quant_main_kv(x)
    assert not torch.equal(dequantize_main_kv(quantize_main_kv(y)), y)  # the case occurs
    assert torch.equal(dequantize_main_kv(requantize_main_kv(y)), y)
    assert torch.equal(requantize_main_kv(x[:0]), quantize_main_kv(x[:0]))
