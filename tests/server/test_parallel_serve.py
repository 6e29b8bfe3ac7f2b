"""``flashserve serve --data-parallel-size 2 --enable-expert-parallel``: the engine core starts
two worker ranks (gloo on loopback) and the API answers through them; a killed worker turns
in-flight requests into errors, new requests and ``/health`` into 503s in the API's error
shape, and nothing hangs."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from api_helpers import API_KEY, spawn_server, stop_server, wait_ready

pytestmark = pytest.mark.slow

ARGS = ["--model", "tiny", "--api-key", API_KEY, "--max-model-len", "512"]
ARGS += ["--page-tokens", "64", "--kv-cache-bytes", str(8 << 20), "--max-num-seqs", "4"]
ARGS += ["--quantization", "none", "--data-parallel-size", "2", "--enable-expert-parallel"]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
_CORE = re.compile(r"in process (\d+), sockets in")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(c) for c in text]
    return out


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _chat(content: str, max_tokens: int) -> dict:
    return {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "logit_bias": {"1": -100},  # no EOS: exactly max_tokens
    }


def _error(response: httpx.Response) -> dict:
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_dp2_ep2_serves_chat_and_a_killed_worker_gives_503s(tiny_cache, tmp_path) -> None:
    server = spawn_server(tiny_cache, tmp_path / "server.log", ARGS, env={"OMP_NUM_THREADS": "1"})
    wait_ready(server)
    try:
        found = _CORE.search(server.log_path.read_text(errors="replace"))
        assert found, server.log_tail()
        workers = [
            c for c in _children(int(found.group(1))) if "engine.parallel.worker" in _cmdline(c)
        ]
        assert len(workers) == 2, server.log_tail()
        with httpx.Client(headers=HEADERS, timeout=60) as http:
            url = server.base_url + "/v1/chat/completions"
            answers = [http.post(url, json=_chat(f"Hello number {i}", 4)) for i in range(3)]
            for r in answers:
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["usage"]["completion_tokens"] == 4
                assert body["choices"][0]["message"]["content"] is not None
            assert http.get(server.base_url + "/health").status_code == 200

            os.kill(workers[1], signal.SIGKILL)
            started = time.monotonic()
            failed = http.post(url, json=_chat("Are you there?", 4))
            # Whether it arrives before the core noticed or after, it ends in a 503.
            assert failed.status_code == 503, failed.text
            _error(failed)
            deadline = time.monotonic() + 20
            while http.get(server.base_url + "/health").status_code != 503:
                assert time.monotonic() < deadline, "health stayed ok after a worker died"
                time.sleep(0.2)
            health = http.get(server.base_url + "/health")
            assert "not running" in _error(health)["message"]
            new = http.post(url, json=_chat("And now?", 4))
            assert new.status_code == 503
            assert _error(new)["type"] == "service_unavailable_error"
            assert time.monotonic() - started < 30
        assert "worker rank 1" in server.log_path.read_text(errors="replace")
    finally:
        stop_server(server)
