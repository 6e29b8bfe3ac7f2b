"""Requests over time: disconnects abort, queued streams get keep-alives, a full server
answers 429, and /metrics and /health tell the truth about it.

Oracle: the engine's own counters and gauges read back through /metrics (a
request gone means running 0, waiting 0, no KV page referenced, one more
``abort``), and promtool's linter for the exposition format.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from contextlib import ExitStack

import httpx
import pytest
from api_helpers import (
    API_KEY,
    EOS_ID,
    MAX_CONCURRENT,
    MAX_NUM_SEQS,
    LiveServer,
    Samples,
)

RUNNING = ("flashserve:num_requests_running", ())
WAITING = ("flashserve:num_requests_waiting", ())
DEVICE_USAGE = ("flashserve:kv_cache_usage_perc", (("tier", "device"),))
ABORTED = ("flashserve:request_success_total", (("finished_reason", "abort"),))
LONG = {
    "model": "deepseek-chat",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 1000,
    "logit_bias": {str(EOS_ID): -100},  # runs until we leave
}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _wait_idle(server: LiveServer, timeout_s: float = 30.0) -> Samples:
    """Poll /metrics until no request runs or waits and no KV page is referenced."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m[RUNNING] == 0 and m[WAITING] == 0 and m[DEVICE_USAGE] == 0:
            return m
        assert time.monotonic() < deadline, f"still busy: {m[RUNNING]=} {m[WAITING]=}"
        time.sleep(0.1)


def _open_stream(stack: ExitStack, server: LiveServer, http: httpx.Client):
    """A streamed LONG request, read up to its first event (the role chunk)."""
    response = stack.enter_context(
        http.stream("POST", server.base_url + "/v1/chat/completions", json={**LONG, "stream": True})
    )
    assert response.status_code == 200
    lines = response.iter_lines()
    first = next(line for line in lines if line)
    assert first.startswith("data: ") and '"role":"assistant"' in first
    return response, lines


def test_stream_disconnect_aborts_and_frees_pages(live_server: LiveServer) -> None:
    before = _wait_idle(live_server)
    with httpx.Client(headers=HEADERS, timeout=60) as http, ExitStack() as stack:
        _, lines = _open_stream(stack, live_server, http)
        content = next(line for line in lines if line.startswith("data: ") and "content" in line)
        assert content
        busy = live_server.metrics()
        assert busy[RUNNING] == 1 and busy[DEVICE_USAGE] > 0
    # The connection is closed: the engine must drop the request and its pages.
    after = _wait_idle(live_server)
    assert after[ABORTED] == before[ABORTED] + 1


def test_non_streamed_disconnect_aborts(live_server: LiveServer) -> None:
    before = _wait_idle(live_server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            live_server.base_url + "/v1/chat/completions", json=LONG, headers=HEADERS, timeout=1.5
        )
    after = _wait_idle(live_server)
    assert after[ABORTED] == before[ABORTED] + 1


def test_queued_streams_keep_alive_and_a_full_server_answers_429(live_server: LiveServer) -> None:
    assert MAX_CONCURRENT > MAX_NUM_SEQS  # some admitted requests must queue in the engine
    before = _wait_idle(live_server)
    with httpx.Client(headers=HEADERS, timeout=60) as http, ExitStack() as stack:
        streams = [_open_stream(stack, live_server, http) for _ in range(MAX_CONCURRENT)]
        # The server holds MAX_CONCURRENT requests: one more is refused.
        r = live_server.post("/v1/chat/completions", {**LONG, "max_tokens": 1})
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_error"
        # The last stream waits behind MAX_NUM_SEQS running ones: comments, no content.
        _, lines = streams[-1]
        waiting = [next(lines) for _ in range(6)]
        assert all(line in (": keep-alive", "") for line in waiting), waiting
        busy = live_server.metrics()
        assert busy[RUNNING] == MAX_NUM_SEQS
        assert busy[WAITING] == MAX_CONCURRENT - MAX_NUM_SEQS
    after = _wait_idle(live_server)
    assert after[ABORTED] == before[ABORTED] + MAX_CONCURRENT
    # Places are free again.
    ok = live_server.post("/v1/chat/completions", {**LONG, "max_tokens": 1})
    assert ok.status_code == 200


def test_start_up_log_has_the_load_summary_and_no_bar(live_server: LiveServer) -> None:
    """Without -v the loader's summary still shows; its log is a file, not a terminal:
    no progress bar (docs/design/checkpoints.md)."""
    log = live_server.log_path.read_text(errors="replace")
    summary = re.search(
        r"INFO engine\.loader\.weight_stream: loaded \S+: [\d.]+ GB \((\d+) B\) from 1 shard\(s\) "
        r"in [\d.]+ s \([\d.]+ GB/s\); placed cpu [\d.]+ GB",
        log,
    )
    assert summary, log[-3000:]
    assert int(summary[1]) > 0
    assert "loading weights" not in log


def test_health_and_metrics_need_no_key(live_server: LiveServer) -> None:
    health = httpx.get(live_server.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    metrics = httpx.get(live_server.base_url + "/metrics", timeout=10)
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")


def test_metrics_after_traffic(live_server: LiveServer) -> None:
    """Every documented metric is exposed with the served model name, and the request
    histograms have counted the requests this session finished."""
    body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "x"}]}
    body["logit_bias"] = {str(EOS_ID): -100}  # exactly 3 tokens in 3 steps
    before = live_server.metrics()
    assert live_server.post("/v1/chat/completions", {**body, "max_tokens": 3}).status_code == 200
    text = live_server.metrics_text()
    after = live_server.metrics()
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        key = (f"flashserve:{name}_count", ())
        assert after[key] == before.get(key, 0) + (
            2 if name == "inter_token_latency_seconds" else 1
        )
    for name in ("num_requests_running", "prompt_tokens_total", "generation_tokens_total"):
        assert f'flashserve:{name}{{model_name="deepseek-flash"}}' in text
    assert 'flashserve:kv_cache_usage_perc{model_name="deepseek-flash",tier="ssd"}' in text
    generated = ("flashserve:generation_tokens_total", ())
    assert after[generated] - before[generated] == 3
    # The vLLM names the Gateway API inference extension's endpoint picker scrapes.
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert f'vllm:{name}{{model_name="deepseek-flash"}}' in text
    assert after[("vllm:generation_tokens_total", ())] == after[generated]
    assert (
        after[("vllm:e2e_request_latency_seconds_count", ())]
        == after[("flashserve:e2e_request_latency_seconds_count", ())]
    )
    assert 'vllm:lora_requests_info{max_lora="0"' in text
    assert 'vllm:cache_config_info{block_size="64"' in text


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_live_scrape_passes_promtool(live_server: LiveServer) -> None:
    """The deploy tests lint a synthetic scrape; this lints the real one."""
    run = subprocess.run(
        ["promtool", "check", "metrics"],
        input=live_server.metrics_text(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    findings = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert run.returncode in (0, 3), findings
    # flashserve keeps vLLM's "prefix:" names; promtool flags the colon and nothing else.
    assert all(f.endswith("metric names should not contain ':'") for f in findings), findings
