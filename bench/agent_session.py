"""Replay a recorded coding-agent session against a launched server: is each turn cheap?

    .venv/bin/python bench/agent_session.py                       # demo model, both APIs
    .venv/bin/python bench/agent_session.py --api openai --rounds 1

The session (``bench/data/agent_session.json``, OpenAI chat format) is a system prompt,
six tool schemas and a task carried out through file reads, a search, edits and test
runs. Request ``k`` is the history up to the session's ``k``-th assistant message, sent
as the agent would send it (streamed), on ``--api openai`` (``/v1/chat/completions``)
and ``--api anthropic`` (``/v1/messages``, the same history as Anthropic blocks). Each
turn records its prompt tokens, cached tokens (``prompt_tokens_details.cached_tokens`` /
``cache_read_input_tokens``), new (prefilled) tokens, SSD-tier hit tokens (from
``/metrics``) and the time to first token.

Three runs per API and round, on one server per phase:

- ``cache``: one tenant for the whole session (what an agent gets);
- ``no-cache``: a fresh tenant (``user`` / ``metadata.user_id``) every turn, so no turn
  finds another's pages (flashserve has no switch that turns the prefix cache off);
- ``restart``: the ``cache`` run's tenant again, after restarting the server on the
  same ``--kv-dir``: the device tier is empty, the SSD tier holds the session.

Requests ask for a few tokens with ``tool_choice`` none: the prompt is the same (tools
are listed whatever the choice), and the first token streams as text at once instead
of waiting in the tool-call parser, so the first delta times the prefill. Results:
``bench/results/agent_session.json``; ``--plot`` draws ``docs/benchmarks/agent-session.png``.
The goal it reports against: from turn 2 on, at least 90 % of every prompt is a cache
hit, and TTFT follows the new tokens, not the prompt length (Pearson correlations).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving.launch import LaunchedServer, ServerSpec

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "data" / "agent_session.json"
OUTPUT = REPO / "bench" / "results" / "agent_session.json"
PLOT = REPO / "docs" / "benchmarks" / "agent-session.png"
RUNS = ("cache", "no-cache", "restart")
APIS = ("openai", "anthropic")
GOAL_HIT_SHARE = 0.90
SSD_HITS = "flashserve:prefix_cache_hits_total"


@dataclass(slots=True)
class Session:
    model: str
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]

    def turns(self) -> list[list[dict[str, Any]]]:
        """The history before each assistant message: what each request sends."""
        return [self.messages[:i] for i, m in enumerate(self.messages) if m["role"] == "assistant"]


def load_session(path: Path) -> Session:
    data = json.loads(path.read_text())
    return Session(data["model"], data["tools"], data["messages"])


@dataclass(slots=True)
class Turn:
    turn: int  # 1-based
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    ssd_hit_tokens: int = 0

    @property
    def new_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "new_tokens": self.new_tokens}


# ---------------------------------------------------------------- the two APIs


def openai_body(session: Session, messages: list[dict[str, Any]], tenant: str, max_tokens: int):
    return {
        "model": session.model,
        "messages": messages,
        "tools": session.tools,
        "tool_choice": "none",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": tenant,
    }


def anthropic_messages(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """OpenAI chat messages as Anthropic's ``system`` and ``messages``: tool calls become
    ``tool_use`` blocks, tool results ``tool_result`` blocks of a user turn."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "system":
            continue
        if m["role"] == "assistant":
            blocks: list[dict[str, Any]] = (
                [{"type": "text", "text": m["content"]}] if m["content"] else []
            )
            for call in m.get("tool_calls", []):
                fn = call["function"]
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": call["id"],
                        "name": fn["name"],
                        "input": json.loads(fn["arguments"]),
                    }
                )
            role, new = "assistant", blocks
        elif m["role"] == "tool":
            role = "user"
            new = [
                {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
            ]
        else:
            role, new = "user", [{"type": "text", "text": m["content"]}]
        if out and out[-1]["role"] == role:
            out[-1]["content"] += new
        else:
            out.append({"role": role, "content": new})
    return system, out


def anthropic_body(session: Session, messages: list[dict[str, Any]], tenant: str, max_tokens: int):
    system, converted = anthropic_messages(messages)
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "input_schema": t["function"]["parameters"],
        }
        for t in session.tools
    ]
    return {
        "model": session.model,
        "system": system,
        "messages": converted,
        "tools": tools,
        "tool_choice": {"type": "none"},
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "metadata": {"user_id": tenant},
    }


def _sse_data(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def openai_turn(client: httpx.Client, body: dict[str, Any]) -> tuple[int, int, float]:
    """(prompt tokens, cached tokens, seconds to the first token's delta)."""
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/v1/chat/completions: {r.status_code} {r.read()[:500]!r}")
        for chunk in _sse_data(r):
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if first is None and any(delta.get(k) for k in ("content", "reasoning_content")):
                    first = time.perf_counter()
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream carried no usage")
    end = first if first is not None else time.perf_counter()
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return usage["prompt_tokens"], cached, end - start


def anthropic_turn(client: httpx.Client, body: dict[str, Any]) -> tuple[int, int, float]:
    """The same from Anthropic's events: ``input_tokens`` excludes cache reads (Anthropic's
    definition), so the prompt is input + cache read + cache creation."""
    start = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    with client.stream("POST", "/v1/messages", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/v1/messages: {r.status_code} {r.read()[:500]!r}")
        for event in _sse_data(r):
            kind = event.get("type")
            if kind == "error":
                raise RuntimeError(f"/v1/messages stream error: {event}")
            if kind == "message_start":
                usage.update(event["message"].get("usage") or {})
            elif kind == "message_delta":
                usage.update({k: v for k, v in (event.get("usage") or {}).items() if v is not None})
            elif kind == "content_block_delta" and first is None:
                first = time.perf_counter()
    end = first if first is not None else time.perf_counter()
    cached = usage.get("cache_read_input_tokens") or 0
    prompt = usage["input_tokens"] + cached + (usage.get("cache_creation_input_tokens") or 0)
    return prompt, cached, end - start


API_CALLS: dict[
    str, tuple[Callable[..., dict[str, Any]], Callable[..., tuple[int, int, float]]]
] = {
    "openai": (openai_body, openai_turn),
    "anthropic": (anthropic_body, anthropic_turn),
}


def ssd_hits(client: httpx.Client) -> float:
    """The server's SSD-tier prefix-hit counter (tokens)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(SSD_HITS) and 'tier="ssd"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def replay(
    base_url: str, session: Session, api: str, tenant: Callable[[int], str], max_tokens: int
) -> list[Turn]:
    """Send every turn of the session in order, one at a time."""
    make_body, send = API_CALLS[api]
    turns = []
    with httpx.Client(base_url=base_url, timeout=600) as client:
        for k, messages in enumerate(session.turns(), start=1):
            before = ssd_hits(client)
            prompt, cached, ttft = send(client, make_body(session, messages, tenant(k), max_tokens))
            ssd = int(ssd_hits(client) - before)
            turns.append(Turn(k, prompt, cached, 1000 * ttft, ssd))
    return turns


# ---------------------------------------------------------------- summary


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return statistics.correlation(xs, ys)


def median_turns(rounds: list[list[Turn]]) -> list[Turn]:
    """Per turn: token counts (the same every round) and the median TTFT."""
    return [
        Turn(
            t[0].turn,
            t[0].prompt_tokens,
            t[0].cached_tokens,
            statistics.median(x.ttft_ms for x in t),
            t[0].ssd_hit_tokens,
        )
        for t in zip(*rounds, strict=True)
    ]


def summarise(turns: list[Turn]) -> dict[str, Any]:
    """Hit share from turn 2 on, the turns short of the goal, and what TTFT follows."""
    later = turns[1:]
    shares = [t.cached_tokens / t.prompt_tokens for t in later]
    ttft = [t.ttft_ms for t in later]
    return {
        "hit_share_from_turn_2": {
            "min": min(shares, default=0.0),
            "median": statistics.median(shares) if shares else 0.0,
        },
        "turns_below_goal": [
            {
                "turn": t.turn,
                "hit_share": round(s, 4),
                "new_tokens": t.new_tokens,
                "prompt_tokens": t.prompt_tokens,
            }
            for t, s in zip(later, shares, strict=True)
            if s < GOAL_HIT_SHARE
        ],
        "ttft_ms_median_from_turn_2": statistics.median(ttft) if ttft else None,
        "corr_ttft_new_tokens": pearson(ttft, [t.new_tokens for t in later]),
        "corr_ttft_prompt_tokens": pearson(ttft, [t.prompt_tokens for t in later]),
        "new_tokens_total": sum(t.new_tokens for t in turns),
        "prompt_tokens_total": sum(t.prompt_tokens for t in turns),
    }


# ---------------------------------------------------------------- driving the servers


def run_all(args: argparse.Namespace, session: Session, log_dir: Path) -> dict[str, Any]:
    """Every round: server A (cache, then no-cache, each API), restart on the same
    --kv-dir, server B (restart runs). Returns per-API, per-run turns of every round."""
    raw: dict[str, dict[str, list[list[Turn]]]] = {a: {r: [] for r in args.runs} for a in args.api}
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    wrapper: list[str] = []
    if args.server_repo:  # `python -c` puts its working directory first on sys.path
        env["PYTHONPATH"] = str(args.server_repo)
        wrapper = ["env", "-C", str(args.server_repo)]
    for rnd in range(args.rounds):
        kv_dir = Path(tempfile.mkdtemp(prefix="flashserve-agent-kv-"))
        spec = ServerSpec(
            args.model,
            [*args.server_args.split(), "--kv-dir", str(kv_dir)],
            ssd=False,
            env=env,
            wrapper=wrapper,
        )
        tenants = {api: f"agent-{api}-{rnd}-{uuid.uuid4().hex[:8]}" for api in args.api}
        try:
            with LaunchedServer(
                spec, log_dir / f"server-{rnd}-a.log", args.startup_timeout
            ) as server:
                for api in args.api:
                    if "cache" in args.runs:
                        one = tenants[api]
                        raw[api]["cache"].append(
                            replay(
                                server.base_url,
                                session,
                                api,
                                lambda k, one=one: one,
                                args.max_tokens,
                            )
                        )
                        _progress(args, rnd, api, "cache", raw[api]["cache"][-1])
                    if "no-cache" in args.runs:
                        fresh = f"fresh-{uuid.uuid4().hex}"
                        turns = replay(
                            server.base_url,
                            session,
                            api,
                            lambda k, fresh=fresh: f"{fresh}-{k}",
                            args.max_tokens,
                        )
                        raw[api]["no-cache"].append(turns)
                        _progress(args, rnd, api, "no-cache", turns)
            if "restart" in args.runs:
                with LaunchedServer(
                    spec, log_dir / f"server-{rnd}-b.log", args.startup_timeout
                ) as server:
                    for api in args.api:
                        one = tenants[api]
                        turns = replay(
                            server.base_url, session, api, lambda k, one=one: one, args.max_tokens
                        )
                        raw[api]["restart"].append(turns)
                        _progress(args, rnd, api, "restart", turns)
        finally:
            shutil.rmtree(kv_dir, ignore_errors=True)
    return raw


def _progress(args: argparse.Namespace, rnd: int, api: str, run: str, turns: list[Turn]) -> None:
    if args.quiet:
        return
    cells = " ".join(f"{t.cached_tokens}/{t.prompt_tokens}:{t.ttft_ms:.0f}ms" for t in turns)
    print(f"round {rnd} {api:9} {run:8} {cells}", file=sys.stderr, flush=True)


def document(
    args: argparse.Namespace, raw: dict[str, dict[str, list[list[Turn]]]]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "command": " ".join(["bench/agent_session.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "model": args.model,
        "server_args": args.server_args,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "goal_hit_share": GOAL_HIT_SHARE,
        "apis": {},
    }
    for api, runs in raw.items():
        out["apis"][api] = {}
        for run, rounds in runs.items():
            if not rounds:
                continue
            med = median_turns(rounds)
            out["apis"][api][run] = {
                "summary": summarise(med),
                "turns": [t.to_dict() for t in med],
                "rounds": [[t.to_dict() for t in r] for r in rounds],
            }
    return out


def plot(doc: dict[str, Any], path: Path) -> None:
    """TTFT per turn of every run, and the cache run's prompt / new tokens per turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_n) = plt.subplots(1, 2, figsize=(12, 4.2))
    styles = {"cache": "-", "no-cache": ":", "restart": "--"}
    for api, runs in doc["apis"].items():
        for run, data in runs.items():
            turns = data["turns"]
            ax_t.plot(
                [t["turn"] for t in turns],
                [t["ttft_ms"] / 1000 for t in turns],
                styles.get(run, "-"),
                marker="o",
                markersize=3,
                label=f"{api}, {run}",
            )
    ax_t.set_xlabel("turn")
    ax_t.set_ylabel("time to first token (s)")
    ax_t.set_title("TTFT per turn (median of rounds)")
    ax_t.legend(fontsize=8)
    ax_t.grid(alpha=0.3)
    first_api = next(iter(doc["apis"].values()))
    if "cache" in first_api:
        turns = first_api["cache"]["turns"]
        x = [t["turn"] for t in turns]
        ax_n.bar(x, [t["prompt_tokens"] for t in turns], color="lightgray", label="prompt tokens")
        ax_n.bar(
            x, [t["new_tokens"] for t in turns], color="tab:orange", label="new (prefilled) tokens"
        )
        ax_n.set_xlabel("turn")
        ax_n.set_ylabel("tokens")
        ax_n.set_title("With the prefix cache: prompt vs new tokens")
        ax_n.legend(fontsize=8)
    fig.suptitle(f"Agent session replay, {doc['model']} model, {doc['date']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="--model of the launched server")
    p.add_argument("--api", nargs="+", choices=APIS, default=list(APIS))
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--rounds", type=int, default=1, help="repeat everything; TTFT is the median")
    p.add_argument("--data", type=Path, default=DATA, help="the recorded session")
    p.add_argument("--turns", type=int, default=0, help="replay only the first N turns (0 = all)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--server-args", default="", help="more `flashserve serve` flags, one string")
    p.add_argument(
        "--server-repo", type=Path, default=None, help="launch the server from another checkout"
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--output", type=Path, default=OUTPUT)
    p.add_argument("--plot", type=Path, nargs="?", const=PLOT, default=None, help="PNG to draw")
    p.add_argument("--quiet", action="store_true")
    p.add_argument(
        "--merge", type=Path, nargs="+", default=None, help="combine result files, run nothing"
    )
    return p.parse_args(argv)


def merge(paths: Sequence[Path]) -> dict[str, Any]:
    """Result files of separate invocations (e.g. the runs split to fit a time budget) as
    one document: the first file's context, every file's runs, the commands listed."""
    docs = [json.loads(p.read_text()) for p in paths]
    out = {**docs[0], "command": [d["command"] for d in docs], "apis": {}}
    for d in docs:
        for api, runs in d["apis"].items():
            out["apis"].setdefault(api, {}).update(runs)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        doc = merge(args.merge)
        args.output.write_text(json.dumps(doc, indent=1) + "\n")
        if args.plot is not None:
            plot(doc, args.plot)
        return 0
    session = load_session(args.data)
    if args.turns:
        cut = [i for i, m in enumerate(session.messages) if m["role"] == "assistant"][: args.turns]
        session.messages = session.messages[: cut[-1] + 1]
    log_dir = args.output.parent / "agent_session_logs"
    doc = document(args, run_all(args, session, log_dir))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot is not None:
        plot(doc, args.plot)
    if not args.quiet:
        for api, runs in doc["apis"].items():
            for run, data in runs.items():
                print(f"{api:9} {run:8} {json.dumps(data['summary'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
