"""Speculative decoding in the engine: a verify step commits exactly what plain decoding
would, and the rows it rejects leave no trace.

Each case runs twice on the same runner in float64: plainly, then with a scripted
proposer drafting from the plain run's streams (spec_helpers.py). The plain run is
the oracle: the speculative run must give the same tokens, the same logits for
every committed token (so the SWA rings, compressor rows and pages a rejected row
wrote were undone: any trace would show in a later row's logits), the same cached
pages byte for byte, and no page held at the end.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest
import torch
from engine_helpers import W, greedy, prompt, run_to_completion, token_stream
from spec_helpers import (
    K,
    ScriptedProposer,
    cached_pages,
    dense_stream,
    make_engine,
    spec_config,
)

from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.model.deepseek_v41.reference import forward_exact

# float64 model, fp32 head (as the release computes logits): the same state gives the
# same logits to the head's rounding, whatever the row count of the GEMM. A trace of
# a rejected row moves them by orders of magnitude more.
EXACT = 1e-6


# The dense reference recomputes every row every step: its case is slow in float64.
@pytest.fixture(params=[pytest.param("reference", marks=pytest.mark.slow), "paged"])
def runner(request) -> str:
    return request.param


def plain_and_speculative(model, runner, phases, modes, **config):
    """Run ``phases`` (lists of requests, each phase run to completion before the next)
    plainly and then speculatively; returns both (engine, recorder, pages, outputs)."""
    runs = []
    streams: dict[tuple[str, int], list[int]] = {}
    for speculative in (False, True):
        proposer = ScriptedProposer(streams, modes) if speculative else None
        engine, recorder, pages = make_engine(model, runner, proposer, **config)
        outputs: dict[str, list] = {}
        for phase in phases:
            for req in phase:
                engine.add_request(
                    Request(req.request_id, req.prompt_token_ids, req.sampling_params)
                )
            outputs.update(run_to_completion(engine))
        if not speculative:
            for phase in phases:
                for req in phase:
                    for i in range(req.sampling_params.n):
                        stream = token_stream(outputs[req.request_id], i)
                        streams[req.request_id, i] = req.prompt_token_ids + stream
        runs.append((engine, recorder, pages, outputs))
    return runs, streams


def assert_same_as_plain(runs, streams, atol=EXACT):
    (plain, plain_rec, _, plain_out), (spec, spec_rec, _, spec_out) = runs
    for (rid, i), stream in streams.items():
        assert token_stream(spec_out[rid], i) == token_stream(plain_out[rid], i)
        want = plain_rec.token_logits((rid, i), len(stream))
        got = spec_rec.token_logits((rid, i), len(stream))
        assert len(got) == len(want) == len(token_stream(plain_out[rid], i))
        for pos, (a, b) in enumerate(zip(got, want, strict=True)):
            diff = (a - b).abs().max().item()
            assert diff < atol, f"{rid}/{i}: token {pos}: logits differ by {diff}"
    for engine in (plain, spec):
        stats = engine.kv.stats()
        assert stats.device_pages_in_use == 0
        assert stats.device_pages_free + stats.device_pages_cached == engine.kv.num_pages


def acceptance(recorder, streams, key) -> list[tuple[int, int]]:
    """(drafts, accepted) of each verify step of ``key``: committed = accepted + 1."""
    return [(r.drafts, n - 1) for r, n in recorder.committed(key, len(streams[key])) if r.drafts]


def assert_counters(engine, recorder, streams) -> list[tuple[int, int]]:
    steps = [s for key in streams for s in acceptance(recorder, streams, key)]
    assert steps, "nothing was verified"
    assert all(0 <= a <= k <= K for k, a in steps)
    c = engine.counters
    assert c.spec_drafts == len(steps)
    assert c.spec_draft_tokens == sum(k for k, _ in steps)
    assert c.spec_accepted_tokens == sum(a for _, a in steps)
    per_pos = c.spec_accepted_per_pos
    assert per_pos == [sum(a > j for _, a in steps) for j in range(K)]
    assert all(x >= y for x, y in itertools.pairwise(per_pos))
    return steps


# ----------------------------------------------------------------- case shapes


def test_chunked_prefill_batch_and_a_cache_hit(engine_model64, runner):
    """Three prompts prefilled in chunks of 7 while the first decodes, so verify chunks
    share steps with prefill chunks; one request's drafts are always right, one's
    always wrong, one's right then wrong at varying positions. Then a fourth request
    hits the third's cached pages (a restore) and verifies its own drafts."""
    reqs = [
        Request("oracle", prompt(17, 1), greedy(8)),
        Request("wrong", prompt(23, 2), greedy(6)),
        Request("mixed", prompt(30, 3), greedy(11)),
    ]
    hit = Request("hit", reqs[2].prompt_token_ids + prompt(9, 4), greedy(6))
    modes = {"oracle": "oracle", "wrong": "wrong", "mixed": "mixed", "hit": "mixed"}
    runs, streams = plain_and_speculative(
        engine_model64, runner, [reqs, [hit]], modes, prefill_chunk_tokens=7
    )
    assert_same_as_plain(runs, streams)
    (plain, _, plain_pages, plain_out), (spec, rec, spec_pages, spec_out) = runs
    steps = assert_counters(spec, rec, streams)
    assert spec.counters.generation_tokens == plain.counters.generation_tokens == 31
    assert all(a == k for k, a in acceptance(rec, streams, ("oracle", 0)))
    assert all(a == 0 for _, a in acceptance(rec, streams, ("wrong", 0)))
    mixed = acceptance(rec, streams, ("mixed", 0)) + acceptance(rec, streams, ("hit", 0))
    assert len({a for _, a in mixed}) > 1 and any(0 < a < k for k, a in mixed)
    assert len(steps) < 31  # fewer verify steps than tokens
    # K capped by the room left: k + 1 committed tokens never pass max_tokens.
    for req in (*reqs, hit):
        key = (req.request_id, 0)
        for row, _ in rec.committed(key, len(streams[key])):
            done = row.num_tokens - len(req.prompt_token_ids)
            assert row.drafts <= min(K, req.sampling_params.max_tokens - done - 1)
    # The restore: the same hit, the same usage.
    assert spec_out["hit"][-1].usage.prompt_cache_hit_tokens == 24  # the prompt's full pages
    assert spec_out["hit"][-1].usage == plain_out["hit"][-1].usage
    # Pages: the same pages cached, byte for byte (no page of a rejected token).
    assert cached_pages(spec, spec_pages) == cached_pages(plain, plain_pages)
    assert len(spec.speculator.proposer.released) == 4  # type: ignore[union-attr]


def test_preemption_and_resume(engine_model64):
    """7 pages of 8: "b" is preempted when "a" needs a page; its drafts are not kept
    and its resume restores from the pages its committed tokens filled. A resume
    replays a bounded window, so the answer depends on where the preemption fell
    (docs/design/semantics.md), and speculation moves that point: the oracle is the
    dense forward under this run's own admissions ("a", never preempted: the plain
    run without page pressure)."""
    prompts = {"a": prompt(30, 7), "b": prompt(20, 8)}
    plain, plain_rec, _ = make_engine(engine_model64, "paged")
    for rid, tokens in prompts.items():
        plain.add_request(Request(rid, tokens, greedy(8)))
    plain_out = run_to_completion(plain)
    # Drafts: the uninterrupted streams.
    streams = {(rid, 0): t + token_stream(plain_out[rid]) for rid, t in prompts.items()}
    proposer = ScriptedProposer(streams, {"a": "mixed", "b": "mixed"}, strict=False)
    engine, rec, _ = make_engine(engine_model64, "paged", proposer, num_pages=7)
    for rid, tokens in prompts.items():
        engine.add_request(Request(rid, tokens, greedy(8)))
    out = run_to_completion(engine)
    assert engine.scheduler.num_preemptions == 1
    assert len(rec.admissions["a", 0]) == 1 and len(rec.admissions["b", 0]) == 2
    for rid, tokens in prompts.items():
        if rid == "a":
            want = token_stream(plain_out["a"])
            want_logits = plain_rec.token_logits(("a", 0), len(streams["a", 0]))
        else:
            want, want_logits = dense_stream(engine_model64, tokens, rec.admissions[rid, 0], 8, W)
        assert token_stream(out[rid]) == want
        final = len(tokens) + len(want)
        got = rec.token_logits((rid, 0), final)
        assert len(got) == len(want)
        for pos, (a, b) in enumerate(zip(got, want_logits, strict=True)):
            assert (a - b).abs().max().item() < EXACT, f"{rid}: token {pos}"
    assert any(r.drafts for r in rec.rows["b", 0])
    stats = engine.kv.stats()
    assert stats.device_pages_in_use == 0
    assert stats.device_pages_free + stats.device_pages_cached == 7


def test_seeded_sampling_n2_with_penalties_bias_and_logprobs(engine_model64):
    """temperature 1, top-p, top-k, penalties, logit_bias, n = 2, logprobs: one sample per
    committed token, so the seeded streams, their logprobs and usage are the plain ones."""
    params = SamplingParams(
        temperature=1.0,
        top_p=0.9,
        top_k=40,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={int(t): 3.0 for t in prompt(4, 9)},
        seed=1234,
        n=2,
        logprobs=2,
        max_tokens=8,
        ignore_eos=True,
    )
    reqs = [Request("s", prompt(20, 11), params)]
    runs, streams = plain_and_speculative(engine_model64, "paged", [reqs], {"s": "mixed"})
    assert_same_as_plain(runs, streams)
    plain_out, spec_out = runs[0][3]["s"], runs[1][3]["s"]
    assert token_stream(plain_out, 0) != token_stream(plain_out, 1)
    for i in range(2):
        want = [lp for o in plain_out for c in o.outputs if c.index == i for lp in c.logprobs]
        got = [lp for o in spec_out for c in o.outputs if c.index == i for lp in c.logprobs]
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
        assert len(got) == 8
        for a, b in zip(got, want, strict=True):
            assert abs(a.logprob - b.logprob) < EXACT
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    assert spec_out[-1].usage == plain_out[-1].usage
    assert runs[1][0].counters.spec_accepted_tokens > 0


def test_abort_after_a_rejection_frees_everything(engine_model64):
    engine, rec, _ = make_engine(engine_model64, "paged", _Reject())
    engine.add_request(Request("a", prompt(20, 5), greedy(12)))
    engine.add_request(Request("b", prompt(23, 6), greedy(6)))
    for _ in range(3):
        engine.step()
    assert any(b.drafts for b in rec.batches)
    assert engine.abort("a")
    out = run_to_completion(engine)
    assert out["a"][-1].outputs[-1].finish_reason == "abort"
    assert out["b"][-1].finished
    assert engine.kv.stats().device_pages_in_use == 0
    assert not rec.inner._undo and not rec.inner._has_state


class _Reject:
    """Always proposes token 5 (almost always rejected), for bookkeeping tests."""

    hidden_layers: tuple[int, ...] = ()

    def propose(self, seq, k, hidden=None):
        from engine.spec_decode.proposer import Draft

        return Draft([5] * k)

    def release(self, seq) -> None:
        pass


def test_pause_above_max_batch_size(engine_model):
    """max_batch_size 1: while two sequences run, steps decode plainly."""
    engine, rec, _ = make_engine(
        engine_model, "paged", _Reject(), speculative_config=spec_config(max_batch_size=1)
    )
    engine.add_request(Request("long", prompt(12, 1), greedy(9)))
    engine.add_request(Request("short", prompt(12, 2), greedy(3)))
    run_to_completion(engine)
    both = [b for b in rec.batches if len(b.decodes) == 2]
    alone = [b for b in rec.batches if len(b.decodes) == 1]
    assert both and not any(b.drafts for b in both)
    assert alone and all(b.drafts for b in alone[:-1])


def test_waiting_sequences_count_toward_max_batch_size(engine_model):
    """One slot, max_batch_size 1: while the second request waits, the first decodes
    plainly; alone afterwards, the second drafts."""
    engine, rec, _ = make_engine(
        engine_model,
        "paged",
        _Reject(),
        max_num_seqs=1,
        speculative_config=spec_config(max_batch_size=1),
    )
    engine.add_request(Request("first", prompt(12, 1), greedy(5)))
    engine.add_request(Request("second", prompt(12, 2), greedy(5)))
    run_to_completion(engine)
    first = [b for b in rec.batches if [s.request_id for s in b.decodes] == ["first"]]
    second = [b for b in rec.batches if [s.request_id for s in b.decodes] == ["second"]]
    assert first and not any(b.drafts for b in first)
    assert second and all(b.drafts for b in second[:-1])


def test_soak_leaves_no_page_and_no_state(engine_model):
    """Many short requests under page pressure (preemption), drafts rejected at random
    positions: the pool ends as it started and the runner holds no state."""
    rng = torch.Generator().manual_seed(3)

    class Random:
        hidden_layers: tuple[int, ...] = ()

        def propose(self, seq, k, hidden=None):
            from engine.spec_decode.proposer import Draft

            return Draft(torch.randint(3, 200, (k,), generator=rng).tolist())

        def release(self, seq) -> None:
            pass

    engine, rec, _ = make_engine(engine_model, "paged", Random(), num_pages=5, max_num_seqs=6)
    out: dict[str, list] = defaultdict(list)
    for i in range(8):
        n = 5 + (i * 7) % 22
        engine.add_request(Request(f"r{i}", prompt(n, 100 + i), greedy(4 + i % 6)))
        if i % 3 == 2:
            for o in engine.step():
                out[o.request_id].append(o)
    for rid, outs in run_to_completion(engine).items():
        out[rid] += outs
    assert len(out) == 8 and all(o[-1].finished for o in out.values())
    for rid, o in out.items():
        assert o[-1].usage.completion_tokens == 4 + int(rid[1:]) % 6
    stats = engine.kv.stats()
    assert stats.device_pages_in_use == 0
    assert stats.device_pages_free + stats.device_pages_cached == 5
    assert not rec.inner._undo and not rec.inner._has_state
    assert engine.scheduler.num_preemptions > 0 and engine.counters.spec_drafts > 0


def test_a_proposer_reading_hidden_states_gets_the_committed_rows(engine_model64):
    """A proposer with ``hidden_layers`` gets each layer's input streams at the rows
    committed since its last call, ending at ``num_tokens - 2``, equal to the exact
    forward's (full depth, so every row runs every layer)."""
    layers = (5, 7)
    calls: list[tuple[int, dict[int, torch.Tensor]]] = []

    class Reader(ScriptedProposer):
        hidden_layers = layers

        def propose(self, seq, k, hidden=None):
            assert hidden is not None
            calls.append((seq.num_tokens, hidden))
            return super().propose(seq, k)

    tokens = prompt(20, 31)
    plain, _, _ = make_engine(engine_model64, "paged", enable_ced=False)
    plain.add_request(Request("h", tokens, greedy(9)))
    stream = tokens + token_stream(run_to_completion(plain)["h"])
    engine, _, _ = make_engine(
        engine_model64, "paged", Reader({("h", 0): stream}, {"h": "mixed"}), enable_ced=False
    )
    engine.add_request(Request("h", tokens, greedy(9)))
    assert token_stream(run_to_completion(engine)["h"]) == stream[len(tokens) :]
    engine.close()  # the capture's hooks come off the shared model

    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        engine_model64.block(l).register_forward_pre_hook(
            lambda m, args, l=l: inputs.__setitem__(l, args[0].detach())
        )
        for l in layers
    ]
    with torch.no_grad():
        forward_exact(engine_model64, torch.tensor(stream))
    for h in hooks:
        h.remove()
    assert len(calls) > 2
    last = 0
    for num_tokens, hidden in calls:
        assert set(hidden) == set(layers)
        for layer, rows in hidden.items():
            first = num_tokens - 1 - rows.shape[0]
            assert rows.shape[0] == min(num_tokens - 1 - last, W) and rows.shape[0] > 0
            want = inputs[layer][first : num_tokens - 1]
            assert (rows - want).abs().max().item() < 1e-9
        last = num_tokens - 1
