"""Running a real coding agent headless against a live server, and reading what it did.

The agents are the npm packages ``scripts/install_agents.sh`` puts in ``.agents/`` (pinned
in tests/agents/npm/). Each runs as a subprocess with a clean environment: HOME and the
XDG directories in a temporary folder (no user config is read or written), the agents'
update checks, telemetry and other background traffic off, no proxy settings and no
credentials from the caller's environment, so the only host it talks to is the loopback
server it is pointed at.

What the agent did is read from the ``RecordingProxy`` between it and the server: the
tool calls the server's responses carried (``served_tool_calls``) and the tool results
the agent sent back in later requests (``returned_tool_results``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from recording_proxy import Exchange

REPO = Path(__file__).resolve().parents[2]
AGENTS_DIR = Path(os.environ.get("FLASHSERVE_AGENTS_DIR") or REPO / ".agents")
SECRET_WORD = "PELICAN"
SECRET_FILE = "secret.txt"
SAVED_RESPONSE_BYTES = 64 << 10
TASK = f"Use the read tool to read the file {SECRET_FILE} and tell me the secret word in it."


@dataclass(frozen=True, slots=True)
class AgentRun:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def events(self) -> list[dict[str, Any]]:
        """The JSON lines of a ``--format json`` / ``stream-json`` run, in order."""
        out = []
        for line in self.stdout.splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out


def agent_binary(name: str) -> Path:
    """``.agents/node_modules/.bin/NAME``; the test skips with a notice when it is absent."""
    path = AGENTS_DIR / "node_modules" / ".bin" / name
    if not path.exists():
        pytest.skip(
            f"coding agent {name!r} not installed in {AGENTS_DIR}: run scripts/install_agents.sh "
            "(needs node and npm; `make setup` runs it where they exist)"
        )
    return path


def isolated_env(tmp: Path, extra: dict[str, str]) -> dict[str, str]:
    """A fresh environment: only PATH and the locale from the caller, the rest under tmp."""
    home = tmp / "home"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "CI": "1",
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "TMPDIR": str(tmp / "tmp"),
        "NO_PROXY": "127.0.0.1,localhost",
    }
    for key in ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    (tmp / "tmp").mkdir(exist_ok=True)
    env.update(extra)
    return env


def project_with_secret(tmp: Path) -> Path:
    """A small git project whose one file holds the secret word (agents expect a repo)."""
    project = tmp / "project"
    project.mkdir()
    (project / SECRET_FILE).write_text(f"The secret word is {SECRET_WORD}.\n")
    subprocess.run(["git", "init", "-q", str(project)], check=False, capture_output=True)
    return project


def run_agent(
    cmd: list[str],
    cwd: Path,
    env: dict[str, str],
    timeout_s: float,
    stop_when: Callable[[], str | None] = lambda: None,
) -> AgentRun:
    """Run one headless agent session; stdin closed so nothing can wait for a person.

    ``stop_when`` is polled every second: a reason it returns ends the session early and
    fails the test with it (an agent refused by the server may retry or compact for
    minutes). The output is also left beside ``cwd`` (agent.stdout, agent.stderr)."""
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    reason = None
    while True:
        try:
            stdout, stderr = proc.communicate(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            reason = stop_when()
            if reason is None and time.monotonic() - started > timeout_s:
                reason = f"it did not finish in {timeout_s:.0f} s"
            if reason is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
                break
    (cwd.parent / "agent.stdout").write_text(stdout)
    (cwd.parent / "agent.stderr").write_text(stderr)
    if reason is not None:
        pytest.fail(f"{cmd[0]} stopped: {reason}; its output:\n{stdout[-4000:]}{stderr[-2000:]}")
    return AgentRun(proc.returncode, stdout, stderr, time.monotonic() - started)


def _sse_payloads(body: bytes) -> Iterator[Any]:
    """The JSON payloads of a response: each ``data:`` line of an event stream, or the body."""
    text = body.decode(errors="replace")
    if not text.lstrip().startswith("{"):
        for line in text.splitlines():
            if line.startswith("data:") and line[5:].strip().startswith("{"):
                yield json.loads(line[5:])
        return
    yield json.loads(text)


def _walk(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)


def served_tool_calls(exchanges: list[Exchange]) -> set[str]:
    """Ids of the tool calls in the server's responses: OpenAI ``tool_calls[].id`` (streamed
    deltas or whole messages) and Anthropic ``tool_use`` blocks."""
    ids: set[str] = set()
    for ex in exchanges:
        if ex.status != 200 or ex.method != "POST":
            continue
        for payload in _sse_payloads(bytes(ex.response)):
            for node in _walk(payload):
                for call in node.get("tool_calls") or []:
                    if isinstance(call, dict) and call.get("id"):
                        ids.add(call["id"])
                if node.get("type") == "tool_use" and node.get("id"):
                    ids.add(node["id"])
    return ids


def returned_tool_results(exchanges: list[Exchange]) -> set[str]:
    """Ids the agent's requests answered with a tool result: OpenAI ``role: tool`` messages'
    ``tool_call_id``, Anthropic ``tool_result`` blocks' ``tool_use_id``."""
    ids: set[str] = set()
    for ex in exchanges:
        body = ex.json_body() if ex.method == "POST" else None
        for message in (body or {}).get("messages") or []:
            if message.get("role") == "tool" and message.get("tool_call_id"):
                ids.add(message["tool_call_id"])
            content = message.get("content")
            for block in content if isinstance(content, list) else []:
                if isinstance(block, dict) and block.get("type") == "tool_result":
                    ids.add(block["tool_use_id"])
    return ids


def first_refusal(exchanges: list[Exchange]) -> str | None:
    """The first answered request that was not 2xx, or None (a ``stop_when`` for
    ``run_agent``: every request of a session must succeed)."""
    for ex in exchanges:
        if ex.status and not 200 <= ex.status < 300:
            return f"the server refused a request: {ex.summary()}: {bytes(ex.response)[:1000]!r}"
    return None


def describe(exchanges: list[Exchange]) -> str:
    """One line per exchange, for assertion messages and the session's report."""
    return "\n".join(ex.summary() for ex in exchanges)


def save_exchanges(exchanges: list[Exchange], path: Path) -> None:
    """Every exchange as JSON (request headers and body, status, response size) for a
    person to read after a run: pytest keeps the last runs' tmp_path folders."""
    rows = []
    for ex in exchanges:
        body: Any = ex.body.decode(errors="replace")
        with contextlib.suppress(ValueError):  # not JSON: kept as text
            body = json.loads(body) if body else None
        rows.append(
            {
                "method": ex.method,
                "path": ex.path,
                "headers": ex.headers,
                "body_bytes": len(ex.body),
                "body": body,
                "status": ex.status,
                "response_headers": ex.response_headers,
                "response_bytes": ex.response_bytes,
                "response": bytes(ex.response[:SAVED_RESPONSE_BYTES]).decode(errors="replace"),
                "seconds": round(ex.seconds, 3),
            }
        )
    path.write_text(json.dumps(rows, indent=1))
