"""Prompt logprobs through the API: ``echo`` + ``logprobs`` (the legacy completions way,
the request lm-eval's ``local-completions`` sends for loglikelihood) and vLLM's
``prompt_logprobs``.

Oracle: the served tiny checkpoint loaded here and run through the dense
reference's exact forward; ``log_softmax`` at each prompt
position for the token that follows. The server runs the paged engine in fp32,
a second code path: in fp32 values that sit on an FP4/FP8 rounding boundary take
the next code on one path (docs/design/semantics.md), and such flips compound
over the prompt; hence a loose bound on the worst position and a tight one on the
median. (tests/engine/sample/test_prompt_logprobs.py holds the engine to 1e-9 in float64.)
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from api_helpers import LiveServer, stream_raw

from engine.config import EngineConfig
from engine.loader.checkpoint import load_checkpoint
from engine.model.deepseek_v41.reference import forward
from flashserve.serve_cmd import tiny_checkpoint


@pytest.fixture(scope="module")
def oracle_model(tiny_cache: Path, live_server: LiveServer):
    """The checkpoint ``--model tiny`` serves (the live server wrote it), loaded as the
    test server loads it (``--quantization none``, tests/server/api_helpers.py). Served
    packed, the paged engine and the dense reference differ by a median of 0.0035 here
    (1e-6 dequantised): the activation rounding turns fp32 summation order into whole
    E4M3 steps now and then (a 1e-7 relative change of the embeddings moves the packed
    logprobs by up to 0.022)."""
    _, net = load_checkpoint(tiny_checkpoint(EngineConfig().seed, tiny_cache), quantization="none")
    return net.eval()


def _reference(model, ids: list[int]) -> list[float]:
    logits = forward(model, torch.tensor(ids)).logits.double().log_softmax(-1)
    return [float(logits[p, ids[p + 1]]) for p in range(len(ids) - 1)]


def _close(got: list[float], want: list[float]) -> None:
    diffs = [abs(a - b) for a, b in zip(got, want, strict=True)]
    assert max(diffs) < 5e-2, max(diffs)
    assert sorted(diffs)[len(diffs) // 2] < 2e-3, diffs  # the median: rounding, not a bug


def test_echo_with_logprobs_scores_every_prompt_token_but_the_first(
    live_server: LiveServer, oracle_model
) -> None:
    # lm-eval's loglikelihood request: token ids, echo, logprobs=1, one new token.
    ids = [1000 + (37 * i) % 9000 for i in range(40)]
    body = {
        "model": "deepseek-chat",
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
    }
    r = live_server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the new token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    _close(lp["token_logprobs"][1 : len(ids)], _reference(oracle_model, ids))
    # What lm-eval reads: a continuation's sum and whether it is greedy.
    continuation = lp["token_logprobs"][30 : len(ids)]
    assert math.isfinite(sum(continuation))
    assert all(len(top) == 1 for top in lp["top_logprobs"][1 : len(ids)])


def test_vllm_prompt_logprobs_field(live_server: LiveServer, oracle_model) -> None:
    ids = [2000 + (53 * i) % 7000 for i in range(24)]
    body = {"model": "deepseek-chat", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    r = live_server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    got = []
    for token_id, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token_id) in entry and len(entry) <= 3
        got.append(entry[str(token_id)]["logprob"])
        ranked = sorted((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] <= 2)
        assert [rank for rank, _ in ranked][:2] == [1, 2]
    _close(got, _reference(oracle_model, ids))


def test_streamed_echo_carries_the_same_scores(live_server: LiveServer) -> None:
    ids = [3000 + (11 * i) % 5000 for i in range(20)]
    body = {
        "model": "deepseek-chat",
        "prompt": ids,
        "max_tokens": 2,
        "logprobs": 0,
        "echo": True,
        "temperature": 0,
    }
    plain = live_server.post("/v1/completions", body).json()["choices"][0]["logprobs"]
    chunks, _ = stream_raw(live_server, "/v1/completions", {**body, "stream": True})
    first = chunks[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"] == plain["token_logprobs"][: len(ids)]


def test_chat_prompt_logprobs_score_the_rendered_prompt(live_server: LiveServer) -> None:
    body = {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": "Score me"}],
        "max_tokens": 1,
        "prompt_logprobs": 1,
    }
    r = live_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    entries = data["prompt_logprobs"]
    assert len(entries) == data["usage"]["prompt_tokens"] and entries[0] is None
    assert all(e is not None and 1 <= len(e) <= 2 for e in entries[1:])
    assert all(v["logprob"] <= 0 for e in entries[1:] for v in e.values())


def test_streamed_chat_carries_the_same_prompt_logprobs_in_its_first_chunk(
    live_server: LiveServer,
) -> None:
    """A streamed chat once dropped them; the oracle is the same request not streamed."""
    body = {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": "Score me, then stream"}],
        "max_tokens": 2,
        "temperature": 0,
        "prompt_logprobs": 2,
    }
    r = live_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    plain = r.json()
    want = plain["prompt_logprobs"]
    assert len(want) == plain["usage"]["prompt_tokens"] and want[0] is None
    chunks, _ = stream_raw(live_server, "/v1/chat/completions", {**body, "stream": True})
    first = chunks[0]
    assert [(c["index"], c["delta"]) for c in first["choices"]] == [
        (0, {"role": "assistant", "content": ""})
    ]
    assert first.get("prompt_logprobs") == want
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]  # greedy: the same answer


def test_streamed_chat_with_a_call_per_choice_sends_the_prompt_logprobs_once(
    live_server: LiveServer,
) -> None:
    """Under a grammar each choice is an engine call and only the first scores the prompt:
    the scores come once, in the first chunk or (if another choice answered first) in a
    chunk of their own, and equal the non-streamed ones."""
    body = {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": "Answer in JSON"}],
        "max_tokens": 2,
        "n": 2,
        "response_format": {"type": "json_object"},
        "prompt_logprobs": 1,
    }
    r = live_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    want = r.json()["prompt_logprobs"]
    assert want is not None and want[0] is None
    chunks, _ = stream_raw(live_server, "/v1/chat/completions", {**body, "stream": True})
    carrying = [k for k, c in enumerate(chunks) if "prompt_logprobs" in c]
    assert len(carrying) == 1
    k = carrying[0]
    # Two engine calls batch differently from run to run: the fp32 values may move in
    # their last bits (1e-6 seen), and with them the rank of a prompt token deep in the
    # vocabulary (84766 vs 84767 seen); the entries' tokens and the best one do not.
    got = chunks[k]["prompt_logprobs"]
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.keys() == w.keys()
        assert all(abs(g[t]["logprob"] - w[t]["logprob"]) < 1e-4 for t in w)
        assert [t for t in g if g[t]["rank"] == 1] == [t for t in w if w[t]["rank"] == 1]
    assert k == 0 or chunks[k]["choices"] == [], chunks[k]
    roles = [c["choices"][0]["index"] for c in chunks[:3] if c["choices"]]
    assert roles[:2] == [0, 1]  # the role chunks still come first, one per choice
