"""Parallel serving: the engine core's scheduler over 2 worker ranks (gloo, loopback).

Oracle: the same checkpoint in one process (``build_engine`` without parallel
flags), float64, the same requests. Each topology launches its 2 workers once
and runs, in that one engine: 8 requests of 5 to 40 tokens (6 more each) in chunked
prefills, a KV pool small enough that sequences are preempted (and restored
from the prefix cache), an abort mid-stream, then a second wave whose prompt
extends a finished one (a prefix-cache hit). Greedy tokens must equal the
single process's; logits agree to rounding in float64 (the TP all-reduce adds
partial products in another order), so argmax ties are not a concern at the
tiny model's logit gaps.

With DP attention each running sequence's pages are open on exactly one
rank's pool and its state goes to that rank only; with the SSD tier on, a
prompt whose device pages were all evicted is restored from SSD (pages written
from one rank's bytes, read back into whichever rank it is placed on). Killing a worker fails the
next step with ``WorkerFailure`` within a bound (no hang).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
import torch

from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.loader.builder import build_engine, checkpoint_fingerprint
from engine.model.deepseek_v41.config import ModelConfig
from engine.parallel.executor import WorkerFailure, free_port, start_worker, worker_specs
from kvstore.device.layout import kv_layout

pytestmark = pytest.mark.slow

PAGE_TOKENS = 16
POOL_PAGES = 10  # per node: 8 sequences of up to 3 pages each do not fit at once
MAX_TOKENS = 6
LENGTHS = (5, 40, 12, 23, 7, 31, 17, 9)
ABORTED = "r5"
HIT = "hit"  # the second wave: r1's prompt and more


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 129000, (n,), generator=g).tolist()


PROMPTS = {f"r{i}": _prompt(n, i) for i, n in enumerate(LENGTHS)}
HIT_PROMPT = PROMPTS["r1"] + _prompt(6, 99)


@pytest.fixture(scope="module")
def checkpoint(engine_checkpoint):
    """The engine tests' tiny checkpoint whose greedy streams vary from token to token
    (larger embeddings, sinks and mHC weights: tests/engine/conftest.py), so a wrong
    row or KV byte changes the tokens."""
    return engine_checkpoint


def _config(**parallel) -> EngineConfig:
    c = ModelConfig.tiny()
    layout = kv_layout(c.kv_source_layer_ids, c.compress_ratios, PAGE_TOKENS, "fp4")
    # DP sums its ranks' pools: half the pages each, so the node holds what one process
    # does and sequences are preempted there too.
    pages = POOL_PAGES // parallel.get("data_parallel_size", 1)
    return EngineConfig(
        dtype="float64",
        quantization="none",
        page_tokens=PAGE_TOKENS,
        prefill_chunk_tokens=16,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        kv_cache_bytes=pages * layout.page_bytes,
        worker_threads=1,
        worker_timeout_s=60.0,
        **parallel,
    )


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _drain(engine, tokens, reasons, check=None, abort_at: str | None = None):
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens.setdefault(out.request_id, []).extend(c.token_ids)
                if c.finish_reason is not None:
                    reasons[out.request_id] = c.finish_reason
            if out.request_id == abort_at and tokens.get(abort_at) and not out.finished:
                engine.abort(abort_at)
                abort_at = None
        if check is not None:
            check(engine)


def _serve(engine, abort: bool, check=None):
    """Both waves; ``(tokens, finish reasons, hit tokens of the second wave)``."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for rid, ids in PROMPTS.items():
        engine.add_request(Request(rid, ids, _greedy()))
    _drain(engine, tokens, reasons, check, ABORTED if abort else None)
    hits: list[int] = []
    engine.add_request(Request(HIT, HIT_PROMPT, _greedy()))
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens.setdefault(out.request_id, []).extend(c.token_ids)
            if out.finished:
                hits.append(out.usage.prompt_cache_hit_tokens)
    return tokens, reasons, hits


@pytest.fixture(scope="module")
def single(checkpoint):
    torch.set_num_threads(1)
    engine = build_engine(_config(), checkpoint)
    try:
        tokens, reasons, hits = _serve(engine, abort=False)
        assert engine.scheduler.num_preemptions > 0  # the pool is small enough
    finally:
        engine.close()
    assert set(reasons.values()) == {"length"}
    return tokens, hits


def _one_rank_per_sequence(engine) -> None:
    """DP: every running sequence is open in exactly one rank's pool, and its
    runner state went to that rank only."""
    kv, runner = engine.kv, engine.runner
    for seq in engine.scheduler.running:
        holders = [d for d, m in enumerate(kv.ranks) if m.holds(seq.seq_id)]
        assert holders == [kv.pool_of(seq.seq_id)]
        if seq.seq_id in runner._where:
            assert runner._where[seq.seq_id] == holders[0]


TOPOLOGIES = {
    # Two "nodes" on loopback, one rank each: node 1's rank is started as
    # ``flashserve serve --node-rank 1`` starts it, and connects to node 0's core.
    "tp2-two-nodes": {"tensor_parallel_size": 2, "nnodes": 2},
    "dp2-ep2": {"data_parallel_size": 2, "enable_expert_parallel": True},
    "tp2-ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_two_ranks_serve_the_tokens_of_one_process(checkpoint, single, name, tmp_path):
    want, want_hits = single
    dp = TOPOLOGIES[name].get("data_parallel_size", 1) > 1
    flags = dict(TOPOLOGIES[name])
    if dp:  # with the SSD tier, shared by both ranks
        flags["kv_dir"] = str(tmp_path / "kv")
    other_node = None
    if flags.get("nnodes", 1) > 1:
        flags["master_port"] = free_port()
        node1 = dataclasses.replace(_config(**flags), node_rank=1)
        model_id = checkpoint_fingerprint(checkpoint)
        (spec,) = worker_specs(
            node1, str(checkpoint), model_id, node1.master_port, node1.master_port + 1
        )
        assert spec.rank == 1
        other_node = start_worker(spec)
    try:
        engine = build_engine(_config(**flags), checkpoint)
    except BaseException:
        if other_node is not None:
            other_node.kill()
        raise
    used: set[int] = set()

    def check(engine) -> None:
        if dp:
            _one_rank_per_sequence(engine)
            used.update(engine.kv.pool_of(s.seq_id) for s in engine.scheduler.running)

    try:
        tokens, reasons, hits = _serve(engine, abort=True, check=check)
        preemptions = engine.scheduler.num_preemptions
        in_use = [m.stats().device_pages_in_use for m in engine.kv.ranks]
        leftover = dict(engine.runner._where)
        if dp:
            again, ssd_hit = _restore_from_ssd(engine)
            assert again == want["r1"]  # the same answer from pages the SSD tier gave back
            assert ssd_hit >= PAGE_TOKENS
            _kill_a_worker(engine)
    finally:
        engine.close()
        if other_node is not None:  # it exits on the core's Stop
            assert other_node.wait(30) == 0
    for rid in PROMPTS:
        if rid == ABORTED:  # cut short: a prefix of the single process's stream
            assert reasons[rid] == "abort"
            assert 0 < len(tokens[rid]) < MAX_TOKENS
            assert tokens[rid] == want[rid][: len(tokens[rid])]
        else:
            assert reasons[rid] == "length"
            assert tokens[rid] == want[rid], rid
    assert tokens[HIT] == want[HIT]
    assert hits[0] >= PAGE_TOKENS and want_hits[0] >= PAGE_TOKENS  # r1's pages were found
    assert preemptions > 0  # the pool is small enough (DP: per rank too)
    assert in_use == [0] * len(in_use) and leftover == {}  # every page and state given back
    if dp:
        assert used == {0, 1}  # both ranks ran sequences


def _restore_from_ssd(engine) -> tuple[list[int], int]:
    """Evict every cached device page (fillers that fill both pools), then ask r1's
    prompt again: its pages come from the SSD tier into the rank it is placed on
    (bytes the core read, shipped with the step), written there by the core from
    bytes fetched from the rank that computed them."""
    fill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # pages, not tokens
    for i in range(4):
        engine.add_request(Request(f"fill{i}", _prompt(72, 200 + i), fill))
    _drain(engine, {}, {})
    engine.kv.flush()
    engine.add_request(Request("again", PROMPTS["r1"], _greedy()))
    tokens: list[int] = []
    ssd = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens.extend(c.token_ids)
            if out.finished:
                ssd = out.usage.prompt_ssd_hit_tokens
    return tokens, ssd


def _kill_a_worker(engine) -> None:
    """SIGKILL rank 1 mid-serving: the next steps fail with WorkerFailure, fast."""
    engine.add_request(Request("doomed", PROMPTS["r3"], _greedy()))
    engine.step()
    os.kill(engine.runner.worker_pids[1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(WorkerFailure, match="worker rank"):
        for _ in range(MAX_TOKENS + 4):
            engine.step()
    assert time.monotonic() - started < 10.0
