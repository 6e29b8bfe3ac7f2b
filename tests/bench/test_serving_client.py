"""The streaming client and the driver: chunk timing rules, request bodies, sessions,
the concurrency cap and /metrics deltas, against a stand-in server with known sleeps."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serving_fake_server import (
    MODEL,
    REPLAY_PER_REQUEST,
    FakeServer,
    FakeState,
    hit_tokens_of,
    prompt_tokens_of,
)

from bench.serving.client import (
    ClientConfig,
    RequestRecord,
    StreamTimer,
    cache_hit_tokens,
    request_body,
)
from bench.serving.driver import Arrivals, run_workload
from bench.serving.metrics import counter_deltas
from bench.serving.workloads import agent_workload, random_workload
from engine.loader.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _data(obj: dict) -> str:
    return "data: " + json.dumps(obj)


def _content(text: str) -> str:
    return _data({"choices": [{"index": 0, "delta": {"content": text}}]})


def _record() -> RequestRecord:
    return RequestRecord(session_id=0, turn=0, group=0, prompt_len=5, max_tokens=3)


def test_stream_timer_hand_timed() -> None:
    rec = _record()
    timer = StreamTimer(rec, "chat", sent=10.0)
    usage = {"prompt_tokens": 12, "completion_tokens": 3, "prompt_cache_hit_tokens": 8}
    for line, now in [
        (": ping", 10.1),
        (_data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), 10.2),
        ("", 10.2),
        (_content("a"), 10.5),  # first text: TTFT 0.5
        (_data({"choices": [{"index": 0, "delta": {"reasoning_content": "r"}}]}), 10.75),
        (_content("b"), 11.0),
        (_data({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), 11.1),
        (_data({"choices": [], "usage": usage}), 11.25),  # E2EL ends here (vLLM)
        ("data: [DONE]", 11.5),
    ]:
        timer.feed(line, now)
    timer.finish()
    assert rec.ttft == pytest.approx(0.5)
    assert rec.itl == pytest.approx([0.25, 0.25])
    assert rec.latency == pytest.approx(1.25)
    assert (rec.text, rec.reasoning) == ("ab", "r")
    assert (rec.prompt_tokens, rec.completion_tokens, rec.cache_hit_tokens) == (12, 3, 8)


def test_stream_timer_completions_and_failures() -> None:
    rec = _record()
    timer = StreamTimer(rec, "completions", sent=0.0)
    timer.feed(_data({"choices": [{"index": 0, "text": "x"}]}), 0.125)
    timer.feed("data: [DONE]", 0.25)
    timer.finish()
    assert (rec.ttft, rec.latency, rec.text) == (0.125, 0.125, "x")

    with pytest.raises(RuntimeError, match="no text"):
        t = StreamTimer(_record(), "chat", 0.0)
        t.feed("data: [DONE]", 1.0)
        t.finish()
    with pytest.raises(RuntimeError, match="DONE"):
        t = StreamTimer(_record(), "chat", 0.0)
        t.feed(_content("a"), 1.0)
        t.finish()
    with pytest.raises(RuntimeError, match="error in stream"):
        StreamTimer(_record(), "chat", 0.0).feed(_data({"error": {"message": "boom"}}), 1.0)


def test_request_body_and_usage_fields() -> None:
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    path, body = request_body(ClientConfig("http://h", "m", ignore_eos=True), history, 7)
    assert path == "/v1/chat/completions"
    assert body["messages"] == history and body["max_tokens"] == 7
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["thinking"] == {"type": "disabled"} and body["ignore_eos"] is True
    path, body = request_body(ClientConfig("http://h", "m", "completions"), history, 3)
    assert path == "/v1/completions" and body["prompt"] == "s\n\nu"
    assert "thinking" not in body and "ignore_eos" not in body
    assert cache_hit_tokens({"prompt_tokens_details": {"cached_tokens": 5}}) == 5
    assert cache_hit_tokens({"prompt_cache_hit_tokens": 4}) == 4
    assert cache_hit_tokens({}) is None


def _agents(tokenizer, n: int = 2, turns: int = 3):
    return agent_workload(
        tokenizer,
        num_agents=n,
        turns=turns,
        system_len=260,
        task_len=8,
        tool_result_len=12,
        output_len=4,
        seed=3,
    )


def test_driver_streams_sessions_over_http(tokenizer) -> None:
    state = FakeState(first_delay_s=0.05, gap_s=0.02)
    workload = _agents(tokenizer)
    with FakeServer(state) as server:
        cfg = ClientConfig(server.base_url, model="")
        result = asyncio.run(
            run_workload(workload, cfg, tokenizer, Arrivals(), show_progress=False)
        )
    assert result.model == MODEL
    assert state.max_in_flight == 2  # both agents at once, each one turn at a time
    assert [(r.session_id, r.turn) for r in result.records] == [
        (a, t) for a in range(2) for t in range(3)
    ]
    bodies = {(b["messages"][1]["content"], len(b["messages"])): b for b in state.bodies}
    for r in result.records:
        assert r.success, r.error
        assert r.text == "w0 w1 w2 w3 " and r.output_tokens == 4
        # The server sleeps 50 ms before the first token and 20 ms between tokens, and
        # sends usage last: lower bounds that client-side jitter cannot break.
        assert r.ttft >= 0.05 and len(r.itl) == 3 and min(r.itl) > 0
        assert r.latency >= 0.05 + 3 * 0.02
        assert sum(r.itl) <= r.latency - r.ttft
        # The server's usage, not the client's count, fills prompt_tokens.
        task = workload.sessions[r.session_id].turns[0].messages[1]["content"]
        body = bodies[(task, 2 + 2 * r.turn)]
        assert r.prompt_tokens == prompt_tokens_of(body)
        assert r.cache_hit_tokens == hit_tokens_of(r.prompt_tokens)
        if r.turn:  # the previous reply is in the history
            assert body["messages"][-2] == {"role": "assistant", "content": "w0 w1 w2 w3 "}
    # Context grows every turn.
    for a in range(2):
        lens = [r.prompt_len for r in result.records if r.session_id == a]
        assert lens == sorted(lens) and len(set(lens)) == 3
    deltas = counter_deltas(result.counters_before, result.counters_after)
    assert deltas == {"replay_tokens": 6 * REPLAY_PER_REQUEST, "preemptions": 3.0}
    assert result.duration_s >= max(r.start + r.latency for r in result.records)


def test_driver_max_concurrency_and_rate(tokenizer) -> None:
    state = FakeState(gap_s=0.005)
    workload = random_workload(tokenizer, num_prompts=4, input_len=6, output_len=2)
    with FakeServer(state) as server:
        cfg = ClientConfig(server.base_url, model="m", endpoint="completions")
        arrivals = Arrivals(request_rate=50.0, max_concurrency=1, seed=1)
        result = asyncio.run(run_workload(workload, cfg, tokenizer, arrivals, show_progress=False))
    assert state.max_in_flight == 1
    assert all(r.success for r in result.records)
    # Completions: the prompt is the text itself, measured at input_len by the client.
    assert all(r.prompt_len == 6 for r in result.records)
    assert [b["prompt"] for b in state.bodies] == [
        workload.sessions[r.session_id].turns[0].messages[0]["content"]
        for r in sorted(result.records, key=lambda r: r.start)
    ]


def test_driver_records_failures_and_skips_the_rest_of_a_session(tokenizer) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/metrics":
            return httpx.Response(404)
        return httpx.Response(500, text="engine on fire")

    workload = _agents(tokenizer, n=1, turns=3)
    cfg = ClientConfig("http://test", model="m")
    result = asyncio.run(
        run_workload(
            workload,
            cfg,
            tokenizer,
            Arrivals(),
            show_progress=False,
            transport=httpx.MockTransport(handler),
        )
    )
    assert calls.count("/v1/chat/completions") == 1
    first, *rest = result.records
    assert not first.success and "HTTP 500" in first.error and "engine on fire" in first.error
    assert all(not r.success and r.error.startswith("skipped") for r in rest)
    assert result.counters_before is None and result.counters_after is None
