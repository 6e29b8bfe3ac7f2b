"""Seeded workloads as sessions of turns, with token lengths measured by the real tokenizer.

A session is a conversation sent one turn at a time: each turn appends its
messages to the history, the server's reply is appended as an assistant
message, and the next turn goes out after the reply (``driver.run_session``).
Single-turn workloads (``random``, ``shared-prefix``) are sessions of one turn.

Text of an exact token length is made of words that are single tokens of the
vocabulary with their leading space (`` the``, `` median``, ...), then measured
with the tokenizer and trimmed or extended until the count is exact.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

Message = dict[str, str]

# Vocabulary entries that decode to a space and 3-10 lower-case letters (byte-level
# BPE spells the space as "Ġ"). Joined with their spaces they re-encode one for one.
_WORD = re.compile(r"Ġ[a-z]{3,10}")

_AGENT_HEADER = (
    "You are a coding agent working in a repository. Call one tool at a time, read "
    "its result, and answer the user in one short sentence. Tools:\n"
)
_AGENT_TOOLS: list[dict[str, Any]] = [
    {
        "name": "read_file",
        "description": "Read a file of the repository.",
        "parameters": {"path": "string", "start_line": "integer", "end_line": "integer"},
    },
    {
        "name": "search_code",
        "description": "Search the repository for a regular expression.",
        "parameters": {"pattern": "string", "path": "string"},
    },
    {
        "name": "run_tests",
        "description": "Run the test suite, or the tests matching a keyword.",
        "parameters": {"keyword": "string"},
    },
    {
        "name": "list_dir",
        "description": "List the entries of a directory.",
        "parameters": {"path": "string"},
    },
]
_AGENT_NOTES = "\nProject notes:\n"
_QUESTIONS = (
    "what does this show?",
    "is the bug here?",
    "which file next?",
    "did that work?",
    "what should change?",
)


class TextMaker:
    """Text of exactly ``n`` tokens (without special tokens), from seeded words."""

    def __init__(self, tokenizer: Tokenizer, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.words = [" " + tokenizer.id_to_token(i)[1:] for i in _word_ids(tokenizer)]
        if not self.words:
            raise ValueError("the tokenizer has no single-token words to build text from")

    def count(self, text: str) -> int:
        """Tokens of ``text`` as the server's tokenizer sees it (no BOS)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, n: int) -> str:
        """`` word word ...`` (leading space kept), adjusted until it is ``n`` tokens."""
        if n < 1:
            raise ValueError(f"text length must be >= 1 token, got {n}")
        words = [self.rng.choice(self.words) for _ in range(n)]
        # Each word is one token, so the first measure is usually exact; the loop
        # covers merges across word boundaries.
        for _ in range(32):
            text = "".join(words)
            have = self.count(text)
            if have == n:
                return text
            if have > n and len(words) > 1:
                words = words[: max(1, len(words) - (have - n))]
            elif have > n:
                words = [self.rng.choice(self.words)]
            else:
                words += [self.rng.choice(self.words) for _ in range(n - have)]
        raise RuntimeError(f"could not make text of exactly {n} tokens")

    def pad_to(self, head: str, n: int) -> str:
        """``head`` followed by words so that the whole is ``n`` tokens."""
        have = self.count(head)
        if have >= n:
            raise ValueError(f"{n} tokens is too short: the fixed text alone is {have} tokens")
        for _ in range(32):
            text = head + self.text(max(1, n - have))
            got = self.count(text)
            if got == n:
                return text
            have += got - n  # the junction merged or split: correct the estimate
        raise RuntimeError(f"could not pad text to exactly {n} tokens")


def _word_ids(tokenizer: Tokenizer) -> list[int]:
    return sorted(i for s, i in tokenizer.get_vocab().items() if _WORD.fullmatch(s))


@dataclass(slots=True)
class Turn:
    """One request of a session: messages appended to the history, then a reply of at
    most ``max_tokens``. ``new_tokens``: tokens of the text this turn adds."""

    messages: list[Message]
    max_tokens: int
    new_tokens: int


@dataclass(slots=True)
class Session:
    session_id: int
    turns: list[Turn]
    group: int = 0  # shared-prefix group (0 elsewhere)


@dataclass(slots=True)
class Workload:
    name: str
    sessions: list[Session]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def agent_workload(
    tokenizer: Tokenizer,
    *,
    num_agents: int,
    turns: int,
    system_len: int,
    task_len: int,
    tool_result_len: int,
    output_len: int,
    seed: int = 0,
) -> Workload:
    """``num_agents`` sessions sharing one system prompt with tool definitions
    (``system_len`` tokens). Turn 0 states a task (``task_len`` tokens); every later
    turn appends a tool result of ``tool_result_len`` tokens and asks a short question,
    so the context grows by the reply plus one tool result per turn."""
    rng = random.Random(seed)
    make = TextMaker(tokenizer, rng)
    header = _AGENT_HEADER + json.dumps(_AGENT_TOOLS, indent=1) + _AGENT_NOTES
    system = make.pad_to(header, system_len)
    sessions = []
    for a in range(num_agents):
        task = "Task:" + make.text(task_len)
        steps = [
            Turn(
                [{"role": "system", "content": system}, {"role": "user", "content": task}],
                output_len,
                system_len + make.count(task),
            )
        ]
        for _ in range(1, turns):
            tool = rng.choice(_AGENT_TOOLS)["name"]
            result = make.text(tool_result_len)
            content = (
                f"Result of {tool}:{result}\n\nAnswer in one short sentence: "
                f"{rng.choice(_QUESTIONS)}"
            )
            steps.append(
                Turn([{"role": "user", "content": content}], output_len, make.count(content))
            )
        sessions.append(Session(a, steps))
    params = dict(
        num_agents=num_agents,
        turns=turns,
        system_len=system_len,
        task_len=task_len,
        tool_result_len=tool_result_len,
        output_len=output_len,
        seed=seed,
    )
    return Workload("agent", sessions, params)


def shared_prefix_workload(
    tokenizer: Tokenizer,
    *,
    num_groups: int,
    prompts_per_group: int,
    system_len: int,
    question_len: int,
    output_len: int,
    seed: int = 0,
) -> Workload:
    """SGLang's generated-shared-prefix: ``num_groups`` system prompts of ``system_len``
    tokens, each with ``prompts_per_group`` questions of ``question_len`` tokens; the
    requests are shuffled so groups interleave."""
    rng = random.Random(seed)
    make = TextMaker(tokenizer, rng)
    sessions = []
    for g in range(num_groups):
        system = make.text(system_len)
        for _ in range(prompts_per_group):
            question = make.text(question_len)
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            turn = Turn(messages, output_len, system_len + question_len)
            sessions.append(Session(0, [turn], group=g))
    rng.shuffle(sessions)
    for i, s in enumerate(sessions):
        s.session_id = i
    params = dict(
        num_groups=num_groups,
        prompts_per_group=prompts_per_group,
        system_len=system_len,
        question_len=question_len,
        output_len=output_len,
        seed=seed,
    )
    return Workload("shared-prefix", sessions, params)


def random_workload(
    tokenizer: Tokenizer, *, num_prompts: int, input_len: int, output_len: int, seed: int = 0
) -> Workload:
    """``num_prompts`` independent prompts of ``input_len`` tokens, ``output_len`` out."""
    make = TextMaker(tokenizer, random.Random(seed))
    sessions = [
        Session(
            i, [Turn([{"role": "user", "content": make.text(input_len)}], output_len, input_len)]
        )
        for i in range(num_prompts)
    ]
    params = dict(num_prompts=num_prompts, input_len=input_len, output_len=output_len, seed=seed)
    return Workload("random", sessions, params)


def completion_prompt(history: list[Message]) -> str:
    """The ``/v1/completions`` prompt of a conversation: its contents joined by blank
    lines (roles dropped, so a one-message prompt is exactly its measured text)."""
    return "\n\n".join(m["content"] for m in history)


def workload_from_args(args: argparse.Namespace, tokenizer: Tokenizer) -> Workload:
    """The workload that ``flashserve bench``'s options (or a script's same-named ones) ask for."""
    if args.workload == "agent":
        return agent_workload(
            tokenizer,
            num_agents=args.num_agents,
            turns=args.turns,
            system_len=args.system_len,
            task_len=args.task_len,
            tool_result_len=args.tool_result_len,
            output_len=args.output_len,
            seed=args.seed,
        )
    if args.workload == "shared-prefix":
        return shared_prefix_workload(
            tokenizer,
            num_groups=args.num_groups,
            prompts_per_group=args.prompts_per_group,
            system_len=args.system_len,
            question_len=args.question_len,
            output_len=args.output_len,
            seed=args.seed,
        )
    return random_workload(
        tokenizer,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
    )
