"""Worst-case /health latency while a server is attacked (docs/design/hardening.md).

Starts ``flashserve serve --model tiny`` on a free loopback port with default limits
(or probes ``--url``), polls /health every 50 ms from a thread, and runs each
attack in turn: the 200 KB enum grammar, nested counted repetitions, 400 distinct
schemas, a 31 MiB prompt, 5,000 prompts x n=128, lone surrogates, deep nesting,
empty-language schemas, slow headers and a slow body, the heavy schema (61
counted-repetition patterns) once and three at once, priced requests (the
launched server has prices and an off-peak window written with ``Z``) and price
settings that must be refused at start-up. Prints one line per
attack (its own time and the worst /health answer during it) and exits 1 if any
/health answer took 1 s or more or was not 200.

    python scripts/health_under_attack.py            # launches a tiny server
    python scripts/health_under_attack.py --url http://127.0.0.1:8000 --api-key KEY
    python scripts/health_under_attack.py --only heavy,price   # attacks whose name has one
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable

import httpx

GOAL_S = 1.0


class Probe(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.worst, self.bad, self._done = url, 0.0, 0, threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._done.is_set():
                started = time.monotonic()
                try:
                    ok = client.get(self.url + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst = max(self.worst, time.monotonic() - started)
                self.bad += not ok
                time.sleep(0.05)

    def stop(self) -> None:
        self._done.set()
        self.join()


def attacks(url: str, key: str | None) -> list[tuple[str, Callable[[], object]]]:
    headers = {"content-type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"

    def post(path: str, body: object) -> int:
        r = httpx.post(url + path, content=json.dumps(body), headers=headers, timeout=300)
        return r.status_code

    def chat(**fields: object) -> dict:
        body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]}
        return {**body, "max_tokens": 2, **fields}

    def fmt(schema: object) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}

    def many_schemas() -> list[int]:
        return [
            post("/v1/chat/completions", chat(response_format=fmt({"enum": [f"v{i}"]})))
            for i in range(400)
        ]

    def slow(partial: bytes) -> bytes:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=120) as sock:
            sock.sendall(partial)
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
            return reply[:12]

    enum = ["x" * 2000 + str(i) for i in range(100)]
    nested = "^((a{1,50}){1,50}){1,20}$"
    call = {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
    past_call = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a", "content": "r"},
    ]
    model = "deepseek-chat"

    def grammar(schema: object) -> Callable[[], int]:
        return lambda: post("/v1/chat/completions", chat(response_format=fmt(schema)))

    def completion(**fields: object) -> Callable[[], int]:
        return lambda: post("/v1/completions", {"model": model, **fields})

    pattern = "^(a|b|c|d|e|f|g|h){1,50}(x|y|z){2,40}[0-9]{3,30}$"
    heavy = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": pattern} for i in range(61)},
        "required": [f"p{i}" for i in range(61)],
    }

    def heavy_at_once() -> list[int]:
        out: list[int] = []
        threads = [threading.Thread(target=lambda: out.append(grammar(heavy)())) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def cache_hits() -> list[int]:  # the second of each pair is a cache hit (priced lower)
        prompt = "the same long prompt " * 200
        return [post("/v1/completions", {"model": model, "prompt": prompt}) for _ in range(4)]

    def priced_stream() -> int:
        body = chat(stream=True, stream_options={"include_usage": True}, max_tokens=16)
        with httpx.stream(
            "POST", url + "/v1/chat/completions", content=json.dumps(body), headers=headers
        ) as r:
            tail = [line for line in r.iter_lines() if line.startswith("data: ")][-2:]
        return r.status_code if tail[-1] == "data: [DONE]" else 599

    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    return [
        ("enum 100 x 2,000 chars", grammar({"type": "string", "enum": enum})),
        ("((a{1,50}){1,50}){1,20}", grammar({"type": "string", "pattern": nested})),
        ("empty language [^\\s\\S]", grammar({"type": "string", "pattern": "^[^\\s\\S]$"})),
        ("400 distinct schemas", many_schemas),
        ("31 MiB prompt", completion(prompt="abc " * (31 << 18))),
        ("5,000 prompts x n=128", completion(prompt=["a"] * 5000, n=128)),
        ("lone surrogate", lambda: post("/v1/chat/completions", chat(user="\ud800"))),
        ("5,000-deep arguments", lambda: post("/v1/chat/completions", chat(messages=past_call))),
        ("slow headers", lambda: slow(head)),
        ("slow body", lambda: slow(head + b"content-length: 99\r\n\r\n{")),
        ("heavy schema (61 patterns)", grammar(heavy)),
        ("heavy schema again (cached)", grammar(heavy)),
        ("heavy schema x3 at once", heavy_at_once),
        ("price: cache hits", cache_hits),
        ("price: streamed usage", priced_stream),
        ("price: --prices 5,1,3 at start", lambda: refused_at_start("--prices", "5,1,3")),
        ("price: --prices 1,1,1e400 at start", lambda: refused_at_start("--prices", "1,1,1e400")),
    ]


def refused_at_start(*flags: str) -> int:
    """``serve`` with bad price settings: its exit status (2: refused before loading)."""
    code = "import sys; from flashserve.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "serve", "--model", "tiny", "--port", "0", *flags]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    return subprocess.run(cmd, env=env, capture_output=True, timeout=300).returncode


def launch() -> tuple[subprocess.Popen, str]:
    log_path = os.path.join(tempfile.mkdtemp(prefix="flashserve-attack-"), "server.log")
    code = "import sys; from flashserve.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", code, "serve", "--model", "tiny", "--port", "0"]
    cmd += ["--max-model-len", "65536", "--log-level", "warning"]
    # Priced, with an off-peak window written in UTC with Z (once a 500 on every request).
    cmd += ["--prices", "0.07,0.27,1.1", "--off-peak-window", "16:30Z-00:30Z"]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with open(log_path) as f:
            text = f.read()
        found = re.search(r"serving \S+ at (http://\S+) ", text)
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            sys.exit(f"the server exited:\n{text[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    sys.exit("the server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: launch a tiny one)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--only", default="", help="comma-separated words: run matching attacks")
    args = parser.parse_args()
    words = [w for w in args.only.split(",") if w]
    proc, url = (None, args.url) if args.url else launch()
    worst = 0.0
    failed = False
    try:
        for name, attack in attacks(url, args.api_key):
            if words and not any(w in name for w in words):
                continue
            probe = Probe(url)
            probe.start()
            started = time.monotonic()
            result = attack()
            took = time.monotonic() - started
            time.sleep(0.2)
            probe.stop()
            shown = result
            if isinstance(result, list):
                shown = ",".join(f"{n}x{c}" for c, n in sorted(Counter(result).items()))
            print(
                f"{name:36s} {took:7.2f} s  -> {shown!s:24.24s} worst /health {probe.worst:.3f} s"
            )
            worst = max(worst, probe.worst)
            failed |= probe.bad > 0 or probe.worst >= GOAL_S
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    print(f"worst /health latency over all attacks: {worst:.3f} s (goal < {GOAL_S} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
