"""The attacks of docs/design/hardening.md against the live server: each one's
reproduction, the new answer, and the server still answering the next request in
normal time.

Most run against the session server; the slow-client timeouts and the grammar time
bound need flags of their own and start a second server.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_helpers import API_KEY, LiveServer, served, spawn_server, stop_server, wait_ready

HEADERS = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
NORMAL_S = 5.0  # a tiny request on the tiny model answers well within this
TIGHT_CONTEXT = 65536  # room for the 25K-token prompt of the enum attack
EMPTY_PATTERNS = ["^[^\\s\\S]$", "[^\\d\\D]", "[^\\w\\W]"]


def post_raw(server: LiveServer, path: str, body: object, timeout: float = 60) -> httpx.Response:
    """POST ``body`` as JSON with non-ASCII escaped (how a lone surrogate travels)."""
    return httpx.post(
        server.base_url + path, content=json.dumps(body), headers=HEADERS, timeout=timeout
    )


def chat(**fields: object) -> dict:
    body: dict = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]}
    body["max_tokens"] = 3
    body.update(fields)
    return body


def schema_format(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    message = error["message"]
    for leak in ("/project/", ".cc:", ".py", "Traceback", "site-packages"):
        assert leak not in message, message
    return message


def assert_still_serving(server: LiveServer) -> None:
    """The next ordinary request is answered, in normal time, and /health is 200."""
    started = time.monotonic()
    r = post_raw(server, "/v1/chat/completions", chat())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert time.monotonic() - started < NORMAL_S
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


# ------------------------------------------- failure stays with its request


@pytest.mark.parametrize("pattern", EMPTY_PATTERNS)
def test_empty_language_grammar_is_a_400_and_the_engine_lives(
    live_server: LiveServer, pattern: str
) -> None:
    body = chat(response_format=schema_format({"type": "string", "pattern": pattern}))
    message = assert_error(
        post_raw(live_server, "/v1/chat/completions", body),
        400,
        "response_format.json_schema.schema",
    )
    assert "no string matches" in message
    assert_still_serving(live_server)


# --------------------------------------------- nothing slow on the event loop


def test_cheap_checks_come_before_the_grammar(live_server: LiveServer) -> None:
    """An out-of-vocabulary logit_bias with a huge enum: refused at once, not compiled."""
    enum = ["x" * 2000 + str(i) for i in range(100)]
    body = chat(
        response_format=schema_format({"type": "string", "enum": enum}),
        logit_bias={"999999999": 1},
    )
    started = time.monotonic()
    assert_error(post_raw(live_server, "/v1/chat/completions", body), 422, "logit_bias")
    assert time.monotonic() - started < 1.0
    assert_still_serving(live_server)


def test_distinct_schemas_do_not_grow_the_server_without_bound(live_server: LiveServer) -> None:
    """The grammar cache is an LRU in bytes; here: many distinct schemas each
    answer normally and the server keeps serving (the bound itself is xgrammar's
    ``cache_limit_bytes``, set from --grammar-cache-bytes)."""
    for i in range(8):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
        body = chat(response_format=schema_format(schema), max_tokens=1)
        assert post_raw(live_server, "/v1/chat/completions", body).status_code == 200
    assert_still_serving(live_server)


# ----------------------------------------------- fan-out is bounded and fair


def test_fan_out_over_the_limit_is_refused_before_tokenising(live_server: LiveServer) -> None:
    body = {"model": "deepseek-chat", "prompt": ["a"] * 5000, "n": 128, "max_tokens": 1}
    started = time.monotonic()
    message = assert_error(post_raw(live_server, "/v1/completions", body), 400, "prompt")
    assert "640000 sequences" in message and "256" in message
    assert time.monotonic() - started < 1.0
    assert_still_serving(live_server)


def _open_stream(server: LiveServer, body: dict) -> tuple[httpx.Client, httpx.Response, Any]:
    """Start a streamed request and read its first event; the caller closes it. The line
    iterator is returned: dropping it would close the stream (and abort the request)."""
    client = httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60)
    response = client.send(
        client.build_request("POST", "/v1/completions", content=json.dumps(body)), stream=True
    )
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")
    return client, response, lines


def test_a_large_fan_out_left_by_its_client_does_not_slow_the_next_request(
    live_server: LiveServer,
) -> None:
    """Once, after 640,000 sequences were abandoned the next tiny request took 37 s.
    Now at most 256 per request; 256 abandoned at once are gone in normal time."""
    body = {"model": "deepseek-chat", "prompt": ["a", "b"], "n": 128, "max_tokens": 200}
    body["stream"] = True
    client, response, _lines = _open_stream(live_server, body)
    response.close()
    client.close()
    assert_still_serving(live_server)
    deadline = time.monotonic() + NORMAL_S
    while time.monotonic() < deadline:
        m = live_server.metrics()
        held = (
            m[("flashserve:num_requests_running", ())] + m[("flashserve:num_requests_waiting", ())]
        )
        if held == 0:
            break
        time.sleep(0.05)
    assert held == 0


def test_metrics_count_every_sequence_of_a_request(live_server: LiveServer) -> None:
    """3 prompts x n=2 = 6 sequences with 2 running slots: /metrics sees 6 in flight."""
    body = {"model": "deepseek-chat", "prompt": ["a b", "c d", "e f"], "n": 2, "max_tokens": 12}
    body["logit_bias"] = {"1": -100}  # no early EOS: every sequence runs its 12 tokens
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(r=post_raw(live_server, "/v1/completions", body))
    )
    worker.start()
    seen = 0
    deadline = time.monotonic() + 30
    while worker.is_alive() and time.monotonic() < deadline:
        m = live_server.metrics()
        running = m.get(("flashserve:num_requests_running", ()), 0)
        waiting = m.get(("flashserve:num_requests_waiting", ()), 0)
        seen = max(seen, running + waiting)
        time.sleep(0.02)
    worker.join(60)
    assert result["r"].status_code == 200
    assert len(result["r"].json()["choices"]) == 6
    assert seen == 6


# ---------------------------------------------------------- no 500 from any input


SURROGATE = "\ud800"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
PAST_CALL = [
    {"role": "user", "content": "x"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}],
    },
    {"role": "tool", "tool_call_id": "a", "content": "r"},
]


def _past_call(arguments: str) -> list[dict]:
    messages = json.loads(json.dumps(PAST_CALL))
    messages[1]["tool_calls"][0]["function"]["arguments"] = arguments
    return messages


CHAT_400 = [
    (
        "message content",
        chat(messages=[{"role": "user", "content": SURROGATE}]),
        "messages[0].content",
    ),
    ("user", chat(user=SURROGATE), "user"),
    ("user_id", chat(user_id="a" + SURROGATE), "user_id"),
    (
        "tool description",
        chat(tools=[{"type": "function", "function": {"name": "f", "description": SURROGATE}}]),
        "tools[0].function.description",
    ),
    (
        "schema key",
        chat(response_format=schema_format({"type": "object", "properties": {SURROGATE: {}}})),
        "response_format.json_schema.schema.properties",
    ),
    (
        "past call arguments (surrogate)",
        chat(messages=_past_call('{"a": "' + SURROGATE + '"}')),
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "past call arguments (5000 deep)",
        chat(messages=_past_call("[" * 5000)),
        "messages[1].tool_calls[0].function.arguments",
    ),
    ("stream as a string", chat(stream="yes"), "stream"),
    ("max_tokens as a string", chat(max_tokens="2"), "max_tokens"),
    (
        "anyOf: []",
        chat(response_format=schema_format({"anyOf": []})),
        "response_format.json_schema.schema",
    ),
    (
        "required excluded by additionalProperties",
        chat(
            response_format=schema_format(
                {
                    "type": "object",
                    "properties": {"a": {"type": "string"}},
                    "required": ["b"],
                    "additionalProperties": False,
                }
            )
        ),
        "response_format.json_schema.schema",
    ),
    (
        "tool parameters no value satisfies",
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"anyOf": []}}}],
            tool_choice="required",
        ),
        "tools",
    ),
    (
        "grammar error with library paths",
        chat(response_format=schema_format({"type": "string", "pattern": "(("})),
        "response_format",
    ),
]


@pytest.mark.parametrize(("name", "body", "param"), CHAT_400, ids=[c[0] for c in CHAT_400])
def test_bad_chat_inputs_are_400s_naming_the_field(
    live_server: LiveServer, name: str, body: dict, param: str
) -> None:
    assert_error(post_raw(live_server, "/v1/chat/completions", body), 400, param)


def test_completion_prompt_with_a_lone_surrogate_is_a_400(live_server: LiveServer) -> None:
    for prompt, param in ((SURROGATE, "prompt"), (["ok", "a" + SURROGATE], "prompt[1]")):
        body = {"model": "deepseek-chat", "prompt": prompt, "max_tokens": 1}
        assert_error(post_raw(live_server, "/v1/completions", body), 400, param)
    assert_still_serving(live_server)


def test_docs_and_schema_follow_the_api_keys(live_server: LiveServer) -> None:
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(live_server.base_url + path, timeout=10).status_code == 401
        r = httpx.get(live_server.base_url + path, headers=HEADERS, timeout=10)
        assert r.status_code == 200
    schema = httpx.get(live_server.base_url + "/openapi.json", headers=HEADERS, timeout=10).json()
    assert "/v1/chat/completions" in schema["paths"]


# ---------------------------------------------------------------- a server with tight limits


@pytest.fixture(scope="module")
def tight_server(
    tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    tmp = tmp_path_factory.mktemp("tight")
    args = ["--model", "tiny", "--api-key", API_KEY, "--max-model-len", str(TIGHT_CONTEXT)]
    args += ["--max-num-seqs", "2", "--page-tokens", "64", "--kv-cache-bytes", str(12 << 20)]
    args += ["--grammar-timeout", "0.5", "--header-timeout", "1", "--body-timeout", "1"]
    args += ["--max-grammar-schema-bytes", str(1 << 20), "--max-concurrent-sequences", "300"]
    with served(tiny_cache, tmp, args) as server:
        yield server


class HealthProbe:
    """Polls /health from a thread; ``worst`` is the slowest answer (seconds)."""

    def __init__(self, base_url: str) -> None:
        self.base_url, self.worst, self.failures = base_url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    ok = client.get(self.base_url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.monotonic() - started)
                self.failures += not ok
                time.sleep(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


def test_admission_counts_sequences_not_requests(tight_server: LiveServer) -> None:
    """--max-concurrent-sequences 300: a request holding 256 sequences leaves room for
    44 more; a second one asking for 64 is a 429 until the first lets go."""
    body = {"model": "deepseek-chat", "prompt": ["a", "b"], "n": 128, "max_tokens": 200}
    client, response, _lines = _open_stream(tight_server, {**body, "stream": True})
    try:
        second = {"model": "deepseek-chat", "prompt": "c", "n": 64, "max_tokens": 1}
        r = post_raw(tight_server, "/v1/completions", second)
        assert "too many sequences" in assert_error(r, 429)
    finally:
        response.close()
        client.close()
    deadline = time.monotonic() + NORMAL_S
    while (r := post_raw(tight_server, "/v1/completions", second)).status_code == 429:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert r.status_code == 200 and len(r.json()["choices"]) == 64


def test_slow_grammar_is_bounded_and_health_stays_fast(tight_server: LiveServer) -> None:
    """The 200 KB enum that once froze the loop for 19 s: now refused at once (its
    prompt, which holds the schema, outgrows this server's KV cache; cheap checks come
    before the engine compiles anything). A slow grammar whose prompt fits (200
    counted-repetition patterns, seconds to compile) is a 400 after the 0.5 s grammar
    timeout, and /health answers within 1 s throughout."""
    enum = ["x" * 2000 + str(i) for i in range(100)]
    started = time.monotonic()
    r = post_raw(
        tight_server,
        "/v1/chat/completions",
        chat(response_format=schema_format({"type": "string", "enum": enum})),
    )
    assert_error(r, 400, "messages")
    assert time.monotonic() - started < 3.0
    pattern = "^(a|b|c|d|e|f|g|h){1,50}(x|y|z){2,40}[0-9]{3,30}$"
    slow = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": pattern} for i in range(200)},
        "required": [f"p{i}" for i in range(200)],
    }
    body = chat(response_format=schema_format(slow))
    with HealthProbe(tight_server.base_url) as probe:
        started = time.monotonic()
        r = post_raw(tight_server, "/v1/chat/completions", body)
        elapsed = time.monotonic() - started
        time.sleep(0.3)
    message = assert_error(r, 400, "response_format")
    assert "did not compile within 0.5 s" in message
    assert elapsed < 3.0
    assert probe.failures == 0 and probe.worst < 1.0, probe.worst
    assert_still_serving(tight_server)


def test_a_31_mib_prompt_is_refused_by_its_bytes_and_health_stays_fast(
    tight_server: LiveServer,
) -> None:
    """A 31 MiB prompt once froze the loop for 60 s before its 400. Its byte length
    proves it exceeds 65,536 tokens (no token stands for more than 256 bytes)."""
    text = "abc " * (31 << 18)
    with HealthProbe(tight_server.base_url) as probe:
        started = time.monotonic()
        r = post_raw(tight_server, "/v1/completions", {"model": "deepseek-chat", "prompt": text})
        elapsed = time.monotonic() - started
        time.sleep(0.3)
    message = assert_error(r, 400, "prompt")
    assert "resulted in at least" in message and "maximum context length is 65536" in message
    assert elapsed < 5.0
    assert probe.failures == 0 and probe.worst < 1.0, probe.worst
    assert_still_serving(tight_server)


def test_slow_headers_and_slow_bodies_get_408(tight_server: LiveServer) -> None:
    host, port = tight_server.base_url.removeprefix("http://").split(":")
    for partial in (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",  # headers never end
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n{",
    ):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(partial)
            started = time.monotonic()
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
            assert time.monotonic() - started < 4.0
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert_still_serving(tight_server)


def test_shutdown_timeout_bounds_a_half_sent_request(
    tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A half-sent body once kept the process alive 150 s after SIGTERM."""
    tmp = tmp_path_factory.mktemp("shutdown")
    args = ["--model", "tiny", "--max-model-len", "256", "--kv-cache-bytes", str(12 << 20)]
    args += ["--shutdown-timeout", "2", "--body-timeout", "600", "--kv-dir", str(tmp / "kv")]
    server = spawn_server(tiny_cache, tmp / "server.log", args)
    wait_ready(server)
    assert server.proc is not None
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length: 1000\r\n\r\n{")
        time.sleep(0.3)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        assert time.monotonic() - started < 10.0
        assert "shutting down the engine" in server.log_tail()
    finally:
        sock.close()
        stop_server(server)


def _running(server: LiveServer) -> float:
    return server.metrics()[("flashserve:num_requests_running", ())]


def test_shutdown_ends_open_requests_with_their_error_not_a_cut_body(
    tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGTERM with a stream and a non-streamed request open: once --shutdown-timeout has
    passed, the stream once lost its connection mid-body (no error, no [DONE]) and the
    log held a CancelledError traceback. Now the stream ends with an error event in the
    API's shape, then [DONE], as a complete chunked body; the other request gets a 503
    body; the process exits 0 without a traceback."""
    tmp = tmp_path_factory.mktemp("drain")
    args = ["--model", "tiny", "--api-key", API_KEY, "--max-model-len", "4096"]
    args += ["--max-num-seqs", "2", "--kv-cache-bytes", str(24 << 20), "--kv-dir", str(tmp / "kv")]
    args += ["--shutdown-timeout", "4", "--quantization", "none"]
    server = spawn_server(tiny_cache, tmp / "server.log", args)
    wait_ready(server)
    assert server.proc is not None
    # Far longer than the drain (a loaded CPU decodes the tiny model at tens of tokens/s).
    long = chat(max_tokens=4000, logit_bias={"1": -100})  # EOS banned: runs to the end
    plain: dict[str, httpx.Response] = {}

    def non_streamed() -> None:
        plain["r"] = post_raw(server, "/v1/chat/completions", long, timeout=60)

    try:
        with httpx.Client(headers=HEADERS, timeout=60) as http:
            body = {**long, "stream": True}
            with http.stream("POST", server.base_url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                seen = [next(lines) for _ in range(4)]  # role chunk, blank line, a delta
                waiter = threading.Thread(target=non_streamed)
                waiter.start()
                deadline = time.monotonic() + NORMAL_S
                while _running(server) < 2:
                    assert time.monotonic() < deadline, "the second request never ran"
                    time.sleep(0.05)
                started = time.monotonic()
                server.proc.send_signal(signal.SIGTERM)
                seen += list(lines)  # a cut body raises httpx.RemoteProtocolError here
        waiter.join(30)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - started < 20.0
    finally:
        stop_server(server)
    payloads = [line.removeprefix("data: ") for line in seen if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]", payloads[-3:]
    error = json.loads(payloads[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable_error" and "shutting down" in error["message"]
    assert "shutting down" in assert_error(plain["r"], 503)
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


# ------------------------------------------------------------ heavy grammars stall no one

HEAVY_PATTERN = "^(a|b|c|d|e|f|g|h){1,50}(x|y|z){2,40}[0-9]{3,30}$"
HEAVY_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "pattern": HEAVY_PATTERN} for i in range(61)},
    "required": [f"p{i}" for i in range(61)],
}
MAX_STREAM_GAP_S = 1.0
# On a machine so loaded that the stream alone already steps slowly (other processes
# on the two cores: a median gap of 0.5 s was seen), a stall is a gap this many times
# its own median step, not 1 s of wall time.
STALL_STEPS = 4
# The heavy schema compiles to 34.5 MB, 72 of its patterns to 40.7 MB: a cap between.
GRAMMAR_CAP = 36 << 20


class StreamGaps:
    """A streamed completion read in a thread: ``worst`` is the longest wait between two
    of its events while ``measuring`` (seconds)."""

    def __init__(self, server: LiveServer) -> None:
        body = {"model": "deepseek-chat", "prompt": "a", "max_tokens": 16000, "stream": True}
        body["logit_bias"] = {"1": -100}  # no EOS: it runs until closed
        self.client, self.response, self.lines = _open_stream(server, body)
        self.worst, self.events, self.measuring = 0.0, 0, False
        self.before: list[float] = []  # gaps before ``measuring``: the stream's own pace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._read()
        except httpx.HTTPError:
            if not self._stop.is_set():  # closed by ``close``: expected
                raise

    def _read(self) -> None:
        last = time.monotonic()
        for line in self.lines:
            now = time.monotonic()
            if self.measuring and line.startswith("data: "):
                self.worst = max(self.worst, now - last)
                self.events += 1
            elif line.startswith("data: "):
                self.before.append(now - last)
            if line.startswith("data: "):
                last = now
            if self._stop.is_set():
                return

    def close(self) -> None:
        self._stop.set()
        self.response.close()
        self.client.close()
        self._thread.join(10)


def _engine_rss_mib(server: LiveServer) -> dict[str, float]:
    """Resident MiB of the API process and each of its children (the engine core)."""
    assert server.proc is not None
    pids = [server.proc.pid]
    children = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    out = {}
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out[str(pid)] = int(line.split()[1]) / 1024
    return out


@pytest.fixture(scope="module")
def grammar_server(
    tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """Room for the heavy schema's prompt (it holds the schema); two running sequences,
    the stream and one heavy request (the others wait, their grammars compiling)."""
    tmp = tmp_path_factory.mktemp("grammar")
    args = ["--model", "tiny", "--api-key", API_KEY, "--max-model-len", "16384"]
    args += ["--max-num-seqs", "2", "--kv-cache-bytes", str(64 << 20), "--quantization", "none"]
    args += ["--kv-dir", str(tmp / "kv"), "--max-grammar-bytes", str(GRAMMAR_CAP)]
    args += ["--grammar-timeout", "60"]  # a loaded CPU compiles slowly; the cap is tested
    with served(tiny_cache, tmp, args) as server:
        yield server


def _cache_the_prompt_of(server: LiveServer, body: dict) -> None:
    """Prefill ``body``'s chat prompt (which holds its schema, 3,535 tokens) as a plain
    completion, without a grammar: the stall test then measures the grammar's work, not
    a long prefill's (which takes seconds of CPU on the tiny model whatever the schema)."""
    from server.chat.chat_encoding import BOS, encode_chat
    from server.openai.protocol import ChatCompletionRequest, reasoning_budget

    request = ChatCompletionRequest.model_validate(body)
    prompt = encode_chat(
        request.messages,
        thinking=False,
        reasoning_effort=reasoning_budget(None),
        response_format=request.response_format,
    )
    assert prompt.startswith(BOS)
    warm = {"model": "deepseek-chat", "prompt": prompt.removeprefix(BOS), "max_tokens": 1}
    assert post_raw(server, "/v1/completions", warm, timeout=300).status_code == 200


@pytest.mark.timeout(300)
def test_a_heavy_schema_compiled_cached_and_sent_three_at_once_stalls_no_stream(
    grammar_server: LiveServer,
) -> None:
    """The 6 KB schema of 61 counted-repetition patterns once stopped every other stream
    for 14 s (its compiled grammar was pickled to the engine core: 309 MB, 24 s), and three
    at once left /health unanswered for 30 s. Now a running stream's longest wait
    between two events stays under 1 s (``STALL_STEPS`` of its own median step on a
    machine loaded past that) while it compiles, while it is served from the cache,
    and while three copies arrive at once; each answers 200 with JSON that has
    all 61 properties or is cut by max_tokens; /health stays under 1 s."""
    body = chat(response_format=schema_format(HEAVY_SCHEMA), max_tokens=4)
    _cache_the_prompt_of(grammar_server, body)
    rss_before = _engine_rss_mib(grammar_server)
    stream = StreamGaps(grammar_server)
    try:
        time.sleep(2.0)  # the stream is decoding: its own pace
        with HealthProbe(grammar_server.base_url) as probe:
            stream.measuring = True
            answers = [post_raw(grammar_server, "/v1/chat/completions", body) for _ in range(2)]
            threads = [
                threading.Thread(
                    target=lambda: answers.append(
                        post_raw(grammar_server, "/v1/chat/completions", body)
                    )
                )
                for _ in range(3)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            time.sleep(0.3)
            stream.measuring = False
    finally:
        stream.close()
    assert [r.status_code for r in answers] == [200] * 5, [r.text[:300] for r in answers]
    for r in answers:
        assert r.json()["usage"]["prompt_cache_hit_tokens"] > 3000  # the prefill was cached
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"  # 4 tokens: cut inside the object
        content = choice["message"]["content"]
        assert content.startswith('{"p0":"') or '{"p0":"'.startswith(content), content
    print(
        f"heavy schema x5: worst stream gap {stream.worst:.3f} s over {stream.events} events"
        f" (median before {sorted(stream.before)[len(stream.before) // 2]:.3f} s),"
        f" worst /health {probe.worst:.3f} s,"
        f" RSS MiB {rss_before} -> {_engine_rss_mib(grammar_server)}"
    )
    assert stream.events > 5, stream.events  # it kept decoding throughout
    pace = sorted(stream.before)[len(stream.before) // 2]
    assert stream.worst < max(MAX_STREAM_GAP_S, STALL_STEPS * pace), (stream.worst, pace)
    assert probe.failures == 0 and probe.worst < 1.0, probe.worst
    assert_still_serving(grammar_server)


def test_a_grammar_past_max_grammar_bytes_is_a_400_naming_the_limit(
    grammar_server: LiveServer,
) -> None:
    """72 of the heavy patterns compile to 40.7 MB: past this server's 36 MiB."""
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": HEAVY_PATTERN} for i in range(72)},
    }
    r = post_raw(
        grammar_server, "/v1/chat/completions", chat(response_format=schema_format(schema))
    )
    message = assert_error(r, 400, "response_format")
    assert f"limit of {GRAMMAR_CAP} bytes (--max-grammar-bytes)" in message
    assert_still_serving(grammar_server)
