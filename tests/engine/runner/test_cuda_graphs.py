"""Decode graphs on the CPU (engine/runner/cuda_graphs.py, engine/runner/graph_capture.py).

No CUDA here: ``RecordingGraphBackend`` records each piece's aten ops and
replays them on the recorded tensors, so host decisions stay frozen as in a
CUDA graph. Oracles: the eager forward of the same engine (float64), vLLM's
bucket list, hand-made buffers, and ``torch.bincount``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import greedy, prompt, reference_engine, run_to_completion, token_stream

from engine.api.request import Request
from engine.config import EngineConfig
from engine.model.deepseek_v41.rope import clear_cos_sin_cache, rope_cos_sin
from engine.model.deepseek_v41.routed_experts import (
    RoutedExperts,
    group_by_expert,
    static_expert_shapes,
)
from engine.runner.cuda_graphs import (
    DecodeGraphs,
    StaticSlots,
    bucket_for,
    capture_sizes,
    decode_graphs_for,
    default_capture_sizes,
)
from engine.runner.graph_capture import HostSyncError, RecordingGraphBackend, SyncGuard
from engine.runner.model_runner import PagedModelRunner

# ------------------------------------------------------------------ buckets


def test_default_sizes_are_vllms_up_to_max_num_seqs():
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    sizes = default_capture_sizes(300)
    assert sizes[-4:] == [256, 272, 288, 300] and 264 not in sizes


def test_given_sizes_are_sorted_deduplicated_and_capped():
    assert capture_sizes(16, [8, 1, 8, 32]) == [1, 8]
    with pytest.raises(ValueError, match="positive"):
        capture_sizes(16, [0, 4])
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(4, [8])


def test_bucket_is_the_smallest_that_holds_the_batch():
    sizes = [1, 2, 4, 8]
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]


def test_engine_config_checks_graph_sizes():
    assert EngineConfig(cuda_graph_sizes=[4, 1]).cuda_graph_sizes == (4, 1)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=[2, -1])


def test_serve_flags_reach_the_engine_config():
    import argparse

    from flashserve.serve_cmd import add_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--enforce-eager", "--cuda-graph-sizes", "1", "8"])
    cfg = engine_config(args)
    assert cfg.enforce_eager and cfg.cuda_graph_sizes == (1, 8)
    cfg = engine_config(parser.parse_args([]))
    assert not cfg.enforce_eager and cfg.cuda_graph_sizes is None


# ------------------------------------------------------------------ slots


def test_slots_pad_with_zeros_and_keep_their_shape():
    slots = StaticSlots(8, torch.device("cpu"))
    slots.put("x", torch.full((8, 3), 7.0))  # a previous, larger step
    slots.fill("x", 4, torch.ones(3, 3))
    assert torch.equal(slots.get("x", 4), torch.tensor([[1.0] * 3] * 3 + [[0.0] * 3]))
    assert torch.equal(slots.buffers["x"][4:], torch.full((4, 3), 7.0))  # other buckets' rows
    with pytest.raises(ValueError, match="slot 'x'"):
        slots.put("x", torch.zeros(2, 4))


# ------------------------------------------------------------------ guard and recorder


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x.sum().item(),
        lambda x: x.nonzero(),
        lambda x: x[x > 0],
        lambda x: torch.bincount(x.long().abs(), minlength=3),
        lambda x: x + torch.tensor([1.0, 2.0, 3.0, 4.0]),
        lambda x: x.tolist(),
        lambda x: bool(x.any()),
        lambda x: int(x.argmax()),
    ],
)
def test_sync_guard_refuses_host_syncs(op):
    x = torch.tensor([1.0, -2.0, 3.0, 0.0])
    op(x)  # fine outside
    with pytest.raises(HostSyncError), SyncGuard():
        op(x)


def test_sync_guard_lets_row_wise_work_through():
    x = torch.randn(4, 8)
    with SyncGuard():
        y = torch.softmax(x, -1) @ x.T
        y[:, 0] = 1.0  # a Python scalar is a fill, not a copy
        torch.topk(y, 2).indices.sort()
        torch.searchsorted(torch.arange(4), torch.tensor(2))  # 0-dim lifted scalar: fine


def test_recorded_graph_replays_new_inputs_with_frozen_host_decisions():
    static = torch.zeros(4)
    out = torch.zeros(4)
    backend = RecordingGraphBackend()
    branch = []

    def fn():
        y = torch.exp(static) * 2
        if not branch:  # a host decision: made once, at capture
            branch.append(True)
            y = y + 1
        out.copy_(y.cumsum(0))

    graph = backend.capture(fn, [static, out])
    static.copy_(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    graph.replay()
    expected = (torch.exp(static) * 2 + 1).cumsum(0)
    assert torch.equal(out, expected)  # new data, and the captured "+ 1" still applied


def test_recorder_refuses_tensors_from_outside_the_graph():
    hidden = torch.ones(4)  # e.g. a cache filled before the capture
    static = torch.zeros(4)
    with pytest.raises(HostSyncError, match="outside"):
        RecordingGraphBackend().capture(lambda: static.add_(hidden), [static])
    RecordingGraphBackend([hidden]).capture(lambda: static.add_(hidden), [static])  # declared


def test_recorder_catches_a_cached_rope_angle_from_before_the_capture():
    """Why capture clears the (cos, sin) cache: a hit would bake stale angles into a graph."""
    inv_freq = torch.rand(4)
    pos = torch.arange(3)
    clear_cos_sin_cache()
    rope_cos_sin(pos, inv_freq)  # cached outside

    def fn():
        rope_cos_sin(pos, inv_freq)[0].sum()

    with pytest.raises(HostSyncError, match="outside"):
        RecordingGraphBackend([inv_freq]).capture(fn, [pos])
    clear_cos_sin_cache()
    RecordingGraphBackend([inv_freq]).capture(fn, [pos])


# ------------------------------------------------------------------ experts


@pytest.mark.parametrize("shard", [False, True])
def test_sync_free_expert_offsets_equal_bincount(shard):
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(11)])
    weights = torch.rand(11, 2, generator=g)
    first, n = (2, 4) if shard else (0, 8)
    routing = group_by_expert(weights, idx, n, first, shard)
    flat = idx.flatten() - first
    counts = torch.bincount(flat[(flat >= 0) & (flat < n)], minlength=n)
    assert torch.equal(
        routing.offsets, torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    )
    assert routing.token.numel() == int(counts.sum())


def test_static_expert_shapes_match_the_grouped_experts_and_hold_no_sync():
    torch.manual_seed(0)
    experts = RoutedExperts(8, 32, 16, 7.0).double()
    x = torch.randn(9, 32, dtype=torch.float64)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, dtype=torch.float64)
    grouped = experts(x, weights, idx)
    with pytest.raises(HostSyncError), SyncGuard():
        experts(x, weights, idx)  # the grouped loop reads counts on the host
    with static_expert_shapes(), SyncGuard():
        static = experts(x, weights, idx)
    torch.testing.assert_close(static, grouped, rtol=0, atol=1e-13)


# ------------------------------------------------------------------ the decode step


@pytest.fixture(scope="module")
def model64(engine_model):
    return copy.deepcopy(engine_model).double().eval()


def _run(model, graphs: bool, static_experts: bool = False, same_length: bool = False):
    """Seven greedy requests of 2..8 tokens: decode batches shrink 7, 6, ..., 1 (buckets
    2 and 8). ``same_length``: four requests of 4 tokens, every decode batch 4 (bucket 4)."""
    engine, recorder = reference_engine(model, runner="paged", max_num_seqs=8)
    inner: PagedModelRunner = recorder.inner
    if graphs:
        backend = RecordingGraphBackend([*model.parameters(), *model.buffers()])
        sizes = (4,) if same_length else (2, 8)
        inner.graphs = DecodeGraphs(model, sizes, backend, torch.device("cpu"))
        inner.graphs.capture()
    if static_experts:
        eager = inner.execute

        def execute(batch):  # as the graphs run: decode-only steps under static shapes
            if batch.prefills:
                return eager(batch)
            with static_expert_shapes():
                return eager(batch)

        inner.execute = execute  # type: ignore[method-assign]
    sizes: list[int] = []
    run = inner.execute

    def sized(batch):
        if not batch.prefills:
            sizes.append(len(batch.decodes))
        return run(batch)

    inner.execute = sized  # type: ignore[method-assign]
    for i in range(4 if same_length else 7):
        tokens = 4 if same_length else 2 + i
        engine.add_request(Request(f"r{i}", prompt(5 + 3 * i, i), greedy(tokens)))
    outputs = run_to_completion(engine)
    return outputs, recorder.logits, inner.graphs, sizes


@pytest.fixture(scope="module")
def runs(model64):
    return _run(model64, graphs=True), _run(model64, graphs=False, static_experts=True)


def test_decode_graphs_run_every_decode_step_with_padding(runs):
    (_, _, graphs, sizes), _ = runs
    assert sizes == [7, 6, 5, 4, 3, 2, 1]
    assert graphs.steps == 7
    assert graphs.padded_rows == 1 + 2 + 3 + 4 + 5 + 0 + 1  # buckets 8 (five steps), 2, 2
    replays = {b: [g.replays for g in gs] for b, gs in graphs.graphs.items()}
    assert replays == {8: [5] * 9, 2: [2] * 9}  # 8 layers: 9 pieces a bucket


def test_padded_graph_steps_equal_the_eager_steps(runs):
    """Real rows of a padded bucket = the unpadded eager step, step after step while the
    batch shrinks through the buckets (stale rows of a larger step never leak). Within
    1e-13, bit for bit on rows 0-3: the CPU kernels round other rows of a 7-row batch
    differently from an 8-row one (a vectorised kernel's scalar tail: the router's
    softplus; MKL's kernel for under 4 rows), ~1e-15 (docs/design/cuda-graphs.md)."""
    (out_g, logits_g, _, _), (out_e, logits_e, _, _) = runs
    for rid in out_e:
        assert token_stream(out_g[rid]) == token_stream(out_e[rid])
    for key, eager in logits_e.items():
        graph = logits_g[key]
        assert len(graph) == len(eager)
        for a, b in zip(graph, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    # r0..r3 are rows 0-3 of every step, inside every kernel's vectorised body.
    for key in [("r0", 0), ("r1", 0), ("r2", 0), ("r3", 0)]:
        assert all(torch.equal(a, b) for a, b in zip(logits_g[key], logits_e[key], strict=True))


def test_a_batch_that_fills_its_bucket_is_bitwise_the_eager_step(model64):
    """No padding, the same row count: every graph step equals the eager one bit for bit."""
    out_g, logits_g, graphs, sizes = _run(model64, graphs=True, same_length=True)
    out_e, logits_e, _, _ = _run(model64, graphs=False, static_experts=True, same_length=True)
    assert sizes == [4, 4, 4] and graphs.steps == 3 and graphs.padded_rows == 0
    for key, eager in logits_e.items():
        assert all(torch.equal(a, b) for a, b in zip(logits_g[key], eager, strict=True))
    assert {r: token_stream(o) for r, o in out_g.items()} == {
        r: token_stream(o) for r, o in out_e.items()
    }


def test_graphs_match_the_default_eager_experts(model64, runs):
    (out_g, logits_g, _, _), _ = runs
    out_d, logits_d, _, _ = _run(model64, graphs=False)
    for rid in out_d:
        assert token_stream(out_g[rid]) == token_stream(out_d[rid])
    for key, eager in logits_d.items():
        for a, b in zip(logits_g[key], eager, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_no_graphs_on_cpu_or_with_enforce_eager(model64):
    assert decode_graphs_for(model64, "cpu", 8, enforce_eager=False) is None
    assert decode_graphs_for(model64, "cuda", 8, enforce_eager=True) is None


def test_graphs_treat_a_sampled_placeholder_as_an_image_row(model64, runs):
    """A decode row whose token is the image id routes with ``bias_vl`` and shuts its
    Engram gate in the graphs as in the eager step: the id is set to a token the
    greedy streams feed back, with a random ``bias_vl``, and both paths must agree."""
    _, (out_e, logits_e, _, _) = runs
    fed_back = token_stream(out_e["r6"])[0]  # the first decode step's input of r6
    model = copy.deepcopy(model64)
    model.image_token_id = fed_back
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.blocks:
            bias = block.ffn.gate.bias_vl
            bias.copy_(torch.randn(bias.shape, generator=g, dtype=torch.float64))
    out_gv, logits_gv, _, _ = _run(model, graphs=True)
    out_ev, logits_ev, _, _ = _run(model, graphs=False, static_experts=True)
    for rid in out_ev:
        assert token_stream(out_gv[rid]) == token_stream(out_ev[rid])
    for key, eager in logits_ev.items():
        for a, b in zip(logits_gv[key], eager, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    # The rule mattered: r6's logits after feeding that token differ from the text model's.
    assert (logits_ev["r6", 0][1] - logits_e["r6", 0][1]).abs().max() > 1e-6
