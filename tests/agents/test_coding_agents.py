"""Real coding agents run one headless session each against ``flashserve serve --model demo``.

OpenCode (through its ``@ai-sdk/openai-compatible`` provider at ``/v1``) and Claude Code
(``claude -p`` with ``ANTHROPIC_BASE_URL`` at ``/anthropic``) are each asked to read a
file through their read tool and say the secret word in it. The demo model is tiny and
rarely says the word, so the test asserts what does not depend on its text: the agent
exits 0 and reports a finished session, and every request the server got was answered
2xx; whenever the server emitted a tool call, the agent executed it and sent its result
back (seen in the agent's requests by the proxy between them, and in the agent's own
JSON output). Whether the sampled model calls a tool at all is not the server's doing:
a Claude Code session without one is run once more, and a session without one prints
a notice. Skipped with a notice where the agents are not installed
(scripts/install_agents.sh, run by ``make setup`` where node and npm exist).

The agents keep their default tool lists (their prompts are the realistic 10K-20K demo
tokens, more than the demo's former 8,192-token context), but only the read-only tools
may run: the demo model's tool calls are close to random, and a random ``bash`` call
must not run on the test machine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import api_helpers
import pytest
from agent_helpers import (
    SECRET_WORD,
    TASK,
    AgentRun,
    agent_binary,
    describe,
    first_refusal,
    isolated_env,
    project_with_secret,
    returned_tool_results,
    run_agent,
    save_exchanges,
    served_tool_calls,
)
from api_helpers import LiveServer, spawn_server, stop_server, wait_ready
from recording_proxy import RecordingProxy

pytestmark = pytest.mark.slow  # a server start and two agent sessions: 3-6 minutes on 2 busy cores

SESSION_TIMEOUT_S = 300.0
KV_CACHE_BYTES = 256 << 20  # a few sessions of 65K tokens at the demo's ~534 B/token
# What one answer may cost: enough for a tool call's arguments, small enough that a
# model that never stops does not turn a session into minutes of decoding.
MAX_OUTPUT_TOKENS = 256
DEMO_MODEL = "deepseek-flash"
# OpenCode drops a tool denied outright from its request, so the tools that act
# (bash, edit/write, task, skill) are denied for every input but one that never
# occurs: they stay in the prompt (its realistic ~10K tokens) and no call of them runs.
# webfetch takes no patterns: denied, it is the one tool missing.
NEVER = "flashserve-test-never-matches"
OPENCODE_PERMISSIONS = {
    **{tool: {"*": "deny", NEVER: "allow"} for tool in ("bash", "edit", "task", "skill")},
    "webfetch": "deny",
    "external_directory": "deny",
}
API_KEY = os.environ.get("FLASHSERVE_AGENTS_API_KEY", api_helpers.API_KEY)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """``flashserve serve --model demo`` on a free loopback port; or, with
    FLASHSERVE_AGENTS_BASE_URL set, a server already running there (``make serve``, a
    branch's build), its key in FLASHSERVE_AGENTS_API_KEY."""
    tmp = tmp_path_factory.mktemp("agents-server")
    running = os.environ.get("FLASHSERVE_AGENTS_BASE_URL")
    if running:
        yield LiveServer(running.rstrip("/"), tmp / "no-log")
        return
    args = ["--model", "demo", "--api-key", API_KEY, "--kv-cache-bytes", str(KV_CACHE_BYTES)]
    server = spawn_server(tmp / "cache", tmp / "server.log", args)
    wait_ready(server)
    try:
        yield server
    finally:
        stop_server(server)


def _log_tail(server: LiveServer) -> str:
    return server.log_tail() if server.log_path.exists() else "(a server not started by the test)"


def _refused(proxy: RecordingProxy) -> str | None:
    return first_refusal(proxy.exchanges)


def _all_answered_2xx(proxy: RecordingProxy, server: LiveServer) -> None:
    exchanges = proxy.exchanges
    assert exchanges, "the agent sent no request to the server"
    bad = [ex for ex in exchanges if not 200 <= ex.status < 300]
    assert not bad, (
        f"requests not answered 2xx:\n{describe(bad)}\n"
        f"first failed body: {bytes(bad[0].response)[:2000]!r}\nserver log:\n{_log_tail(server)}"
    )


def _tool_round_trip(proxy: RecordingProxy) -> set[str]:
    """Tool calls the server emitted whose results the agent sent back."""
    exchanges = proxy.exchanges
    served = served_tool_calls(exchanges)
    returned = returned_tool_results(exchanges)
    assert served, f"the server's responses carried no tool call:\n{describe(exchanges)}"
    assert served & returned, (
        f"no tool call of the server came back as a tool result: served {sorted(served)}, "
        f"returned {sorted(returned)}\n{describe(exchanges)}"
    )
    return served & returned


def _opencode_config(base_url: str) -> dict:
    """The provider config the README shows, plus the read-only permissions of the test."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "flashserve": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "flashserve",
                "options": {"baseURL": base_url + "/v1", "apiKey": API_KEY},
                "models": {
                    DEMO_MODEL: {
                        "name": "DeepSeek Flash (flashserve demo)",
                        "limit": {"context": 65536, "output": MAX_OUTPUT_TOKENS},
                    }
                },
            }
        },
        "model": f"flashserve/{DEMO_MODEL}",
        "small_model": f"flashserve/{DEMO_MODEL}",
        "autoupdate": False,
        "share": "disabled",
        "permission": OPENCODE_PERMISSIONS,
    }


# The binaries are fixtures listed before the server, so a machine without them skips
# before a server is started for nothing.
@pytest.fixture
def opencode() -> Path:
    return agent_binary("opencode")


@pytest.fixture
def claude() -> Path:
    return agent_binary("claude")


def test_opencode_reads_a_file_through_a_tool(
    opencode: Path, demo_server: LiveServer, tmp_path: Path
) -> None:
    def prepare(proxy_url: str, project: Path) -> tuple[list[str], dict[str, str]]:
        (project / "opencode.json").write_text(json.dumps(_opencode_config(proxy_url), indent=2))
        env = {
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",  # models.dev: the provider is all in config
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",  # no ~/.claude prompts or skills
        }
        return [str(opencode), "run", "--format", "json", TASK], env

    run, proxy = _session("opencode", prepare, demo_server, tmp_path)
    events = run.events()
    assert events, f"opencode reported nothing: {run.stdout[-2000:]}"
    answer = "".join(e["part"].get("text", "") for e in events if e.get("type") == "text")
    print(f"opencode answer ({SECRET_WORD in answer=}): {answer[:200]!r}")
    if not served_tool_calls(proxy.exchanges):
        print("opencode session: the demo model called no tool (its sampling, not the server)")
        return
    round_trip = _tool_round_trip(proxy)
    tools_run = [
        e["part"]
        for e in events
        if e.get("type") == "tool_use" and e["part"]["callID"] in round_trip
    ]
    assert tools_run, f"opencode reported none of the tool calls {sorted(round_trip)}: {events}"
    assert all(t["state"]["status"] in ("completed", "error") for t in tools_run), tools_run


# Claude Code's switches for a machine that talks to nothing but this server (the
# variables DeepSeek's guide and Claude Code's own settings reference name).
CLAUDE_CODE_QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # updates, telemetry, error reports...
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    "CLAUDE_CODE_DISABLE_AUTO_MEMORY": "1",
    "API_TIMEOUT_MS": str(int(SESSION_TIMEOUT_S * 1000)),  # CPU prefill of ~30K tokens is slow
}


# The demo model does not call a tool in every session (the agents sample at their own
# temperature; Claude Code with thinking on): a session without a call is run once
# more. Whether the model calls a tool is its sampling, not the server's doing, so
# what is asserted always is the session (exit 0, every request 2xx, a finished
# result); the tool round trip is asserted whenever the server emitted a call.
CLAUDE_ATTEMPTS = 2


def test_claude_code_reads_a_file_through_a_tool(
    claude: Path, demo_server: LiveServer, tmp_path: Path
) -> None:
    for attempt in range(1, CLAUDE_ATTEMPTS + 1):
        run, proxy = _claude_session(claude, demo_server, tmp_path / f"attempt{attempt}")
        if served_tool_calls(proxy.exchanges):
            break
        print(f"claude session {attempt}: the model called no tool")
    events = run.events()
    final = [e for e in events if e.get("type") == "result"]
    assert final and final[-1]["subtype"] == "success" and not final[-1]["is_error"], final
    answer = final[-1]["result"]
    assert isinstance(answer, str), f"claude reported no answer: {final[-1]}"
    print(f"claude answer ({SECRET_WORD in answer=}): {answer[:200]!r}")
    if not served_tool_calls(proxy.exchanges):
        return
    round_trip = _tool_round_trip(proxy)
    results = [
        block
        for e in events
        if e.get("type") == "user"
        for block in e["message"]["content"]
        if isinstance(block, dict) and block.get("type") == "tool_result"
    ]
    reported = {b["tool_use_id"] for b in results}
    assert reported & round_trip, f"claude reported none of {sorted(round_trip)}: {events}"


def _claude_session(
    claude: Path, demo_server: LiveServer, tmp_path: Path
) -> tuple[AgentRun, RecordingProxy]:
    """One ``claude -p`` session through a recording proxy; it must exit 0 with every
    request answered 2xx whatever the model does."""

    def prepare(proxy_url: str, _: Path) -> tuple[list[str], dict[str, str]]:
        env = {
            "ANTHROPIC_BASE_URL": proxy_url + "/anthropic",
            "ANTHROPIC_AUTH_TOKEN": API_KEY,
            "CLAUDE_CONFIG_DIR": str(tmp_path / "home" / ".claude"),
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
            **CLAUDE_CODE_QUIET,
        }
        # dontAsk: a tool not in --allowedTools is refused, not asked about (no one to ask).
        cmd = [str(claude), "-p", "--output-format", "stream-json", "--verbose"]
        cmd += ["--no-session-persistence", "--permission-mode", "dontAsk"]
        cmd += ["--allowedTools", "Read,Glob,Grep", "--", TASK]
        return cmd, env

    tmp_path.mkdir()
    return _session("claude", prepare, demo_server, tmp_path)


def _session(
    name: str,
    prepare: Callable[[str, Path], tuple[list[str], dict[str, str]]],
    demo_server: LiveServer,
    tmp_path: Path,
) -> tuple[AgentRun, RecordingProxy]:
    """One headless agent session in a fresh project, through a recording proxy:
    ``prepare(proxy_url, project)`` gives its command and environment. Whatever the
    model does, the agent must exit 0 and every request must be answered 2xx."""
    project = project_with_secret(tmp_path)
    with RecordingProxy(demo_server.base_url) as proxy:
        cmd, extra = prepare(proxy.url, project)
        env = isolated_env(tmp_path, extra)
        try:
            run = run_agent(cmd, project, env, SESSION_TIMEOUT_S, partial(_refused, proxy))
        finally:
            save_exchanges(proxy.exchanges, tmp_path / "exchanges.json")
    print(f"{name} session: {run.seconds:.1f} s ({tmp_path}/exchanges.json)")
    print(describe(proxy.exchanges))
    assert run.returncode == 0, (
        f"{name} exited {run.returncode}:\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
    )
    _all_answered_2xx(proxy, demo_server)
    return run, proxy
