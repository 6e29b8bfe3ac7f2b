"""``flashserve serve`` with its engine core in a process of its own (the default): a killed
core turns in-flight streams into an error event, new requests and ``/health`` into 503s in
the API's error shape, and nothing hangs; SIGINT stops the core and removes its sockets."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
from api_helpers import API_KEY, LiveServer, served

ARGS = ["--model", "tiny", "--api-key", API_KEY, "--max-model-len", "512"]
ARGS += ["--page-tokens", "64", "--kv-cache-bytes", str(8 << 20), "--max-num-seqs", "2"]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
LONG = {
    "model": "deepseek-chat",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 400,
    "logit_bias": {"1": -100},  # no EOS: it runs until the core dies
    "stream": True,
}
_CORE = re.compile(r"in process (\d+), sockets in (\S+)\)")


def _core(server: LiveServer) -> tuple[int, Path]:
    found = _CORE.search(server.log_path.read_text(errors="replace"))
    assert found, server.log_tail()
    return int(found.group(1)), Path(found.group(2))


def _gone(pid: int, timeout_s: float = 15.0) -> bool:
    """The process ``pid`` has exited (and been reaped, or is a zombie)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
        except (FileNotFoundError, IndexError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def _assert_error_shape(body: dict, status_message: str) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert status_message in err["message"], body


def test_a_killed_engine_core_gives_errors_and_503s_not_a_hang(tiny_cache, tmp_path) -> None:
    with served(tiny_cache, tmp_path, ARGS) as server:
        pid, sockets = _core(server)
        assert sockets.is_dir() and not _gone(pid, 0.0)
        with httpx.Client(headers=HEADERS, timeout=30) as http:
            with http.stream("POST", server.base_url + "/v1/chat/completions", json=LONG) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                before = []
                for line in lines:  # up to the first token's event
                    if line.startswith("data: {"):
                        before.append(json.loads(line[6:]))
                        if before[-1]["choices"] and before[-1]["choices"][0]["delta"].get(
                            "content"
                        ):
                            break
                # Kill the core mid-stream; the rest of the stream must end, with an error.
                os.kill(pid, signal.SIGKILL)
                rest = [line[6:] for line in lines if line.startswith("data: ")]
            assert before, "no event before the kill"
            errors = [json.loads(e) for e in rest if e.startswith('{"error"')]
            assert errors and rest[-1] == "[DONE]", rest[-5:]
            _assert_error_shape(errors[0], "not running")
            assert errors[0]["error"]["type"] == "service_unavailable_error"

            health = http.get(server.base_url + "/health")
            assert health.status_code == 503
            _assert_error_shape(health.json(), "not running")
            new = http.post(
                server.base_url + "/v1/chat/completions", json={**LONG, "stream": False}
            )
            assert new.status_code == 503
            _assert_error_shape(new.json(), "not running")
        assert server.proc is not None
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
    assert not sockets.exists()


def test_sigint_stops_the_engine_core_and_removes_its_sockets(tiny_cache, tmp_path) -> None:
    with served(tiny_cache, tmp_path, ARGS) as server:
        pid, sockets = _core(server)
        ok = server.post("/v1/chat/completions", {**LONG, "stream": False, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert server.proc is not None
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
        assert "shutting down the engine" in server.log_tail()
    assert _gone(pid)
    assert not sockets.exists()
