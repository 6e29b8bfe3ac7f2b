"""Speculative decoding under parallel serving: verify steps through the worker ranks.

Oracle: the same checkpoint in one process, float64, **without** speculation. Each
case launches 2 worker processes (gloo, loopback) and decodes greedily with
``ngram`` (prompts that repeat themselves, so drafts are accepted and rejected)
or ``dspark`` (the tiny checkpoint's random drafter, run in the engine core on the
layer inputs the workers send back: drafts are proposed, nearly all rejected).
Tokens must equal the plain single-process run's: a draft the core rejects leaves
no trace on any rank (each worker rolls back its rings and compressor rows the
next time the sequence runs), and a worker's mirror holds the committed tokens only.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.loader.builder import build_engine

pytestmark = pytest.mark.slow

MAX_TOKENS = 16


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 129000, (n,), generator=g).tolist()


# Repeating prompts on which this checkpoint's greedy output falls into loops of its
# own (found by trying a few), so prompt lookup's drafts are accepted in places and
# rejected in others.
PROMPTS = {
    "run": [_prompt(1, 2)[0]] * 12,
    "triple": _prompt(3, 3) * 6,
    "sixes": _prompt(6, 5) * 4,
}


@pytest.fixture(scope="module")
def checkpoint(engine_checkpoint):
    """The engine tests' tiny checkpoint whose greedy streams vary from token to token
    (larger embeddings, sinks and mHC weights: tests/engine/conftest.py), so a wrong
    row or KV byte changes the tokens."""
    return engine_checkpoint


def _config(**kw) -> EngineConfig:
    return EngineConfig(
        dtype="float64",
        quantization="none",
        page_tokens=16,
        prefill_chunk_tokens=16,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        worker_threads=1,
        worker_timeout_s=60.0,
        **kw,
    )


def _run(engine) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for rid, ids in PROMPTS.items():
        engine.add_request(Request(rid, ids, params))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                tokens.setdefault(out.request_id, []).extend(c.token_ids)
    return tokens


@pytest.fixture(scope="module")
def plain(checkpoint):
    torch.set_num_threads(1)
    engine = build_engine(_config(), checkpoint)
    try:
        return _run(engine)
    finally:
        engine.close()


def _flag(method: str) -> str:
    return json.dumps({"method": method, "num_speculative_tokens": 3})


@pytest.mark.parametrize(
    ("parallel", "method"),
    [
        ({"tensor_parallel_size": 2}, "ngram"),
        ({"data_parallel_size": 2, "enable_expert_parallel": True}, "ngram"),
        ({"data_parallel_size": 2}, "dspark"),
        ({"tensor_parallel_size": 2, "enable_expert_parallel": True}, "dspark"),
    ],
    ids=["tp2-ngram", "dp2-ep-ngram", "dp2-dspark", "tp2-ep-dspark"],
)
def test_speculation_on_worker_ranks_gives_the_plain_tokens(checkpoint, plain, parallel, method):
    engine = build_engine(_config(speculative_config=_flag(method), **parallel), checkpoint)
    try:
        tokens = _run(engine)
        counters = engine.stats().counters
    finally:
        engine.close()
    assert tokens == plain
    assert all(len(t) == MAX_TOKENS for t in tokens.values())
    assert counters.spec_drafts > 0  # drafts were proposed and verified on the workers
    # Some drafts were rejected and the sequences decoded on: the workers rolled back.
    assert counters.spec_accepted_tokens < counters.spec_draft_tokens
    if method == "ngram":
        assert counters.spec_accepted_tokens > 0
