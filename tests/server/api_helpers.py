"""The live test server: how it is started, its settings, and small HTTP helpers.

The server runs as a subprocess through the real command line (tiny checkpoint
written into a cache directory, loaded by the real loader, served by uvicorn),
so the tests see exactly what a client of ``make serve`` sees. Its tiny
checkpoint is kept in pytest's cache under a key hashed from the checkpoint
code, so it is written once (about 15 s) and rewritten only when that code
changes.

Settings chosen for tests: two API keys (flag and environment), at most two
running sequences (a third request queues), a short keep-alive, a small
context and KV cache (limits are reachable, page counts visible), 8 output
tokens by default (fuzzed requests stay cheap), vLLM-named metric aliases on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-flashserve-test-0123456789"
ENV_API_KEY = "sk-flashserve-env-9876543210"
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 2
MAX_CONCURRENT = 4
KEEP_ALIVE_S = 0.25
MAX_BODY_BYTES = 256 << 10
DEFAULT_MAX_TOKENS = 8
PAGE_TOKENS = 64
KV_CACHE_BYTES = 12 << 20  # a few hundred pages of the tiny model
STARTUP_TIMEOUT_S = 300.0
EOS_ID = 1
THINK_END_ID = 128822  # "</think>" in the DeepSeek tokenizer
# Files whose change can change the tiny checkpoint on disk.
CHECKPOINT_CODE = (
    "engine/loader/checkpoint.py",
    "engine/loader/files.py",
    "engine/loader/formats.py",
    "engine/loader/checkpoint_writer.py",
    "engine/model/deepseek_v41/config.py",
    "kernels/weight_formats.py",
)
_URL = re.compile(r"serving \S+ at (http://\S+) ")

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass(slots=True)
class LiveServer:
    base_url: str
    log_path: Path
    proc: subprocess.Popen | None = None

    def client(self, api_key: str = API_KEY, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, **kwargs)

    def beta_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/beta", api_key=API_KEY)

    def post(self, path: str, body: object, *, api_key: str | None = API_KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.post(self.base_url + path, json=body, headers=headers, timeout=120)

    def metrics_text(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=10).text

    def metrics(self) -> Samples:
        """Every sample of /metrics by (name, sorted labels other than model_name)."""
        out: Samples = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def checkpoint_cache(cache_root: Path) -> Path:
    """``FLASHSERVE_CACHE`` for the tests: keyed by the checkpoint code's hash."""
    h = hashlib.blake2b(digest_size=8)
    for name in CHECKPOINT_CODE:
        path = REPO / name
        if path.is_file():
            h.update(path.read_bytes())
    return cache_root / f"flashserve-tiny-{h.hexdigest()}"


def start_server(cache: Path, tmp: Path) -> LiveServer:
    """``flashserve serve --model tiny --port 0 ...``; returns once /health answers."""
    args = ["--model", "tiny", "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-concurrent-requests", str(MAX_CONCURRENT)]
    args += ["--keep-alive-seconds", str(KEEP_ALIVE_S), "--max-body-bytes", str(MAX_BODY_BYTES)]
    args += ["--default-max-tokens", str(DEFAULT_MAX_TOKENS), "--page-tokens", str(PAGE_TOKENS)]
    args += ["--kv-cache-bytes", str(KV_CACHE_BYTES), "--kv-dir", str(tmp / "kv")]
    args += ["--vllm-metric-aliases"]
    # Image URLs of the loopback host a test serves (tests/server/openai/test_api_images.py).
    args += ["--allowed-media-domains", "127.0.0.1"]
    # The API tests serve the tiny model dequantised: its packed path (per-step
    # tile decode, activation quantisation) costs 1.2-1.6x per CPU step, and these
    # tests check the API, not numerics. The packed default is tested at engine level
    # (tests/engine/test_packed_linears.py, test_checkpoint_experts.py) and through
    # HTTP by tests/bench/test_serving_e2e.py, which launches with the defaults.
    args += ["--quantization", "none"]
    server = spawn_server(cache, tmp / "server.log", args)
    wait_ready(server)
    return server


@contextlib.contextmanager
def served(cache: Path, tmp: Path, args: list[str]) -> Iterator[LiveServer]:
    """A ``flashserve serve ARGS`` on a free loopback port for the ``with`` block."""
    server = spawn_server(cache, tmp / "server.log", args)
    wait_ready(server)
    try:
        yield server
    finally:
        stop_server(server)


def spawn_server(
    cache: Path, log_path: Path, args: list[str], env: dict[str, str] | None = None
) -> LiveServer:
    """Start ``flashserve serve --host 127.0.0.1 --port 0 ARGS`` (any role); ``wait_ready``
    waits for it, so several servers can start side by side."""
    full_env = dict(os.environ)
    full_env["FLASHSERVE_CACHE"] = str(cache)
    full_env["FLASHSERVE_API_KEYS"] = ENV_API_KEY
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    cmd = [sys.executable, "-c", "import sys; from flashserve.cli import main; sys.exit(main())"]
    cmd += ["serve", "--host", "127.0.0.1", "--port", "0", "--log-level", "warning", *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return LiveServer("", log_path, proc)


def wait_ready(server: LiveServer) -> None:
    """Wait until the server's /health answers (stops it if it never does)."""
    assert server.proc is not None
    try:
        server.base_url = _wait_for_url(server.proc, server.log_path)
    except BaseException:
        stop_server(server)
        raise


def stop_server(server: LiveServer) -> None:
    """SIGINT (uvicorn's graceful stop, then the engine shuts down); SIGKILL if it lingers."""
    proc, server.proc = server.proc, None
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait_for_url(proc: subprocess.Popen, log_path: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        found = _URL.search(text)
        if found and httpx.get(found.group(1) + "/health", timeout=5).status_code == 200:
            return found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"flashserve serve exited ({proc.returncode}):\n{text[-4000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"flashserve serve did not start in {STARTUP_TIMEOUT_S} s")


def sse_lines(lines: Iterator[str]) -> Iterator[str]:
    """``data`` payloads and ``:`` comment lines of an SSE body, in order."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]
        elif line.startswith(":"):
            yield line


def stream_raw(server: LiveServer, path: str, body: dict) -> tuple[list[dict], list[str]]:
    """The JSON events of a streamed request, and every ``data`` payload / comment line."""
    with httpx.stream(
        "POST",
        server.base_url + path,
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = list(sse_lines(response.iter_lines()))
    events = [json.loads(e) for e in raw if e != "[DONE]" and not e.startswith(":")]
    return events, raw
