"""Verify steps on the decode graphs (engine/runner/cuda_graphs.py): a decode row and its
drafts replay the pieces at the bucket of the step's total row count, the attention
side runs each verify chunk eagerly (docs/design/cuda-graphs.md, "Verify steps").

No CUDA here: ``RecordingGraphBackend`` records the pieces and replays them, host
decisions frozen as in a CUDA graph. Oracles, in float64: the same speculative run
on the eager forward (logits of every verify row), and a plain run without
speculation (tokens, and the logits of every committed token: a trace of a rejected
row that the undo missed would move a later row's logits).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from engine_helpers import greedy, prompt, run_to_completion, token_stream
from spec_helpers import ScriptedProposer, make_engine

from engine.api.request import Request
from engine.model.deepseek_v41.routed_experts import static_expert_shapes
from engine.runner.cuda_graphs import DecodeGraphs, max_step_rows
from engine.runner.graph_capture import RecordingGraphBackend
from engine.spec_decode.build import build_proposer
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.dspark_proposer import DSparkProposer

# The logits of a graph step against the eager step: the CPU kernels round a row
# differently when the row count around it changes (padding to the bucket), ~1e-15
# (docs/design/cuda-graphs.md, "Testing without a GPU"); as the decode graphs' tests.
GRAPH_ATOL = 1e-13
# A committed token's logits, speculative against plain: other GEMM row counts and
# the fp32 head (as tests/engine/spec_decode/test_verify_step.py).
EXACT = 1e-6


def test_step_rows_cover_the_verify_batches_the_engine_can_schedule():
    assert max_step_rows(8) == 8
    assert max_step_rows(8, 3) == 32  # every sequence drafts K = 3
    assert max_step_rows(8, 3, max_batch_size=2) == 8  # 2 x 4 verify rows < 8 plain
    assert max_step_rows(8, 3, max_batch_size=4) == 16
    assert max_step_rows(64, 4, max_num_batched_tokens=100) == 100  # the step's row budget


def captured(model, sizes: tuple[int, ...]) -> DecodeGraphs:
    backend = RecordingGraphBackend([*model.parameters(), *model.buffers()])
    graphs = DecodeGraphs(model, sizes, backend, torch.device("cpu"), layer_inputs=True)
    graphs.capture()
    return graphs


def static_eager(recorder) -> None:
    """Run decode-only steps eagerly under static expert shapes, as the pieces run them
    (the same per-row arithmetic; the grouped experts sum in another order)."""
    eager = recorder.inner.execute

    def execute(batch):
        if batch.prefills:
            return eager(batch)
        with static_expert_shapes():
            return eager(batch)

    recorder.inner.execute = execute


class CappedProposer(ScriptedProposer):
    """The scripted drafts (right for the first ``j``, ``j`` cycling), at most
    ``caps[request id]`` of them: sequences of one step verify different ``k``."""

    def __init__(self, streams, caps: dict[str, int]) -> None:
        super().__init__(streams, {})
        self.caps = caps

    def propose(self, seq, k, hidden=None):
        return super().propose(seq, min(k, self.caps[seq.request_id]), hidden)


REQUESTS = {"a": (prompt(21, 1), 1), "b": (prompt(30, 2), 2), "c": (prompt(13, 3), 3)}


@pytest.fixture(scope="module")
def model64(engine_model64):
    return copy.deepcopy(engine_model64)


@pytest.fixture(scope="module")
def graphs64(model64):
    """Buckets 4 and 12: three sequences verify at most 2 + 3 + 4 = 9 rows a step."""
    return captured(model64, (4, 12))


def keep_every_layer_input(recorder) -> list[dict]:
    """Capture every layer's input (``capture_hidden``) and keep what each step gave."""
    inner = recorder.inner
    inner.capture_hidden(tuple(range(len(inner.model.layers))))
    taken: list[dict] = []
    execute = inner.execute

    def step(batch):
        out = execute(batch)
        taken.append(inner.take_hidden())
        return out

    inner.execute = step
    return taken


@pytest.fixture(scope="module")
def scripted_runs(model64, graphs64):
    """Plain (eager), speculative eager and speculative on graphs; the speculative runs
    keep every layer's input rows of every step (the Engram layers and the embedding's
    included, which the tiny drafter's one target layer is not)."""
    streams: dict[tuple[str, int], list[int]] = {}
    caps = {rid: k for rid, (_, k) in REQUESTS.items()}
    graphs = graphs64
    runs, inputs = [], []
    for mode in ("plain", "eager", "graphs"):
        proposer = None if mode == "plain" else CappedProposer(streams, caps)
        engine, recorder, _ = make_engine(model64, "paged", proposer, prefill_chunk_tokens=64)
        if mode == "graphs":
            recorder.inner.graphs = graphs
        else:
            static_eager(recorder)
        if mode != "plain":
            inputs.append(keep_every_layer_input(recorder))
        for rid, (ids, _) in REQUESTS.items():
            engine.add_request(Request(rid, ids, greedy(9)))
        outputs = run_to_completion(engine)
        if mode == "plain":
            for rid, (ids, _) in REQUESTS.items():
                streams[rid, 0] = ids + token_stream(outputs[rid])
        runs.append((engine, recorder, outputs))
        engine.close()
    return runs, streams, graphs, inputs


def test_a_verify_step_on_graphs_equals_the_eager_verify_step(scripted_runs):
    runs, _, graphs, _ = scripted_runs
    _, eager_rec, eager_out = runs[1]
    spec, graph_rec, graph_out = runs[2]
    verify = [b for b in graph_rec.batches if b.drafts and not b.prefills]
    # Steps whose sequences verify different k, all of them replayed on the graphs.
    assert any(len({len(d) for d in b.drafts.values()}) == 3 for b in verify)
    assert graphs.verify_steps == len(verify) > 0
    assert graphs.padded_rows > 0
    for rid in REQUESTS:
        assert token_stream(graph_out[rid]) == token_stream(eager_out[rid])
        got, want = graph_rec.rows[rid, 0], eager_rec.rows[rid, 0]
        assert [(r.num_tokens, r.drafts) for r in got] == [(r.num_tokens, r.drafts) for r in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=GRAPH_ATOL)
    counters = spec.stats().counters
    assert 0 < counters.spec_accepted_tokens < counters.spec_draft_tokens


def test_verify_steps_on_graphs_commit_the_plain_tokens(scripted_runs):
    """The rejected rows' rollback (verify_undo.py) holds on graphs: every committed
    token has the plain run's logits, and no page is held at the end."""
    runs, streams, _, _ = scripted_runs
    (_, plain_rec, plain_out), _, (spec, graph_rec, graph_out) = runs
    for (rid, i), stream in streams.items():
        assert token_stream(graph_out[rid]) == token_stream(plain_out[rid])
        want = plain_rec.token_logits((rid, i), len(stream))
        got = graph_rec.token_logits((rid, i), len(stream))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert (a - b).abs().max().item() < EXACT
    stats = spec.kv.stats()
    assert stats.device_pages_in_use == 0


@pytest.fixture(scope="module")
def looping64(tiny_model):
    """The tiny model without ``engine_model``'s scaled embeddings: its greedy streams
    settle into repeats, which prompt lookup drafts (and misses where they change)."""
    return copy.deepcopy(tiny_model).double().eval()


def test_ngram_on_graphs_gives_the_plain_tokens(looping64):
    """Prompt lookup with graphs on: the plain run's tokens, drafts both taken and
    rejected. Buckets 4 and 6: a step of 7 to 12 verify rows is past the largest and
    runs eagerly, so the undo crosses from graph steps to eager ones and back."""
    model = looping64
    prompts = {"a": prompt(6, 1) * 4, "b": prompt(20, 2), "c": prompt(5, 3) * 3}
    flag = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    graphs = captured(model, (4, 6))
    streams = []
    for proposer in (None, build_proposer(SpeculativeConfig.parse(flag), model)):
        engine, recorder, _ = make_engine(model, "paged", proposer, prefill_chunk_tokens=64)
        if proposer is not None:
            recorder.inner.graphs = graphs
        for rid, ids in prompts.items():
            engine.add_request(Request(rid, ids, greedy(12)))
        outputs = run_to_completion(engine)
        streams.append({rid: token_stream(outputs[rid]) for rid in prompts})
    assert streams[0] == streams[1]
    counters = engine.stats().counters
    assert 0 < counters.spec_accepted_tokens < counters.spec_draft_tokens
    verify = [b for b in recorder.batches if b.drafts and not b.prefills]
    rows = [len(b.decodes) + sum(map(len, b.drafts.values())) for b in verify]
    assert 0 < graphs.verify_steps == sum(r <= 6 for r in rows) < len(rows)


def test_graph_steps_give_a_drafter_the_eager_layer_inputs(scripted_runs):
    """Hidden capture on graphs (the piece boundaries) against the eager forward's
    pre-hooks: the same sequences, layers and first positions each step, the same rows
    to the graph tolerance, verify chunks included."""
    _, _, graphs, (eager, graph) = scripted_runs
    assert graphs.verify_steps > 0 and len(graph) == len(eager)
    for got, want in zip(graph, eager, strict=True):
        assert got.keys() == want.keys()
        for seq_id, layers in want.items():
            assert got[seq_id].keys() == layers.keys()
            for layer, (first, rows) in layers.items():
                assert got[seq_id][layer][0] == first
                torch.testing.assert_close(got[seq_id][layer][1], rows, rtol=0, atol=GRAPH_ATOL)


def test_dspark_on_graphs_drafts_as_eager_and_gives_the_plain_tokens(model64, graphs64):
    """The tiny model's random drafter (backoff off: it drafts every decode) with graphs
    on: the plain run's tokens, and the drafts of the eager speculative run step by
    step (the drafter's input is the target layer's rows the graph steps hand over)."""
    spec = SpeculativeConfig("dspark", 3)
    flag = json.dumps({"method": "dspark", "num_speculative_tokens": 3})
    prompts = {"a": prompt(37, 5), "b": prompt(20, 6)}
    before = graphs64.verify_steps
    streams, drafts = [], []
    for mode in ("plain", "eager", "graphs"):
        proposer = None if mode == "plain" else DSparkProposer(model64, spec, backoff=False)
        config = {} if proposer is None else {"speculative_config": flag}
        engine, recorder, _ = make_engine(
            model64, "paged", proposer, prefill_chunk_tokens=16, **config
        )
        if mode == "graphs":
            recorder.inner.graphs = graphs64
        for rid, ids in prompts.items():
            engine.add_request(Request(rid, ids, greedy(8)))
        outputs = run_to_completion(engine)
        engine.close()
        streams.append({rid: token_stream(outputs[rid]) for rid in prompts})
        drafts.append([(dict(b.drafts), bool(b.prefills)) for b in recorder.batches])
    assert streams[0] == streams[1] == streams[2]
    assert drafts[1] == drafts[2] and sum(len(d) for d, _ in drafts[2]) >= 2 * 6
    # Every decode-only step that verified ran on the graphs.
    assert graphs64.verify_steps - before == sum(bool(d) and not p for d, p in drafts[2]) > 0
