"""Workloads: exact token lengths under the real tokenizer, structure, seeds; arrivals."""

from __future__ import annotations

import argparse
import random

import numpy as np
import pytest

from bench.serving.arrivals import arrival_offsets
from bench.serving.workloads import (
    TextMaker,
    agent_workload,
    completion_prompt,
    random_workload,
    shared_prefix_workload,
    workload_from_args,
)
from engine.loader.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_text_of_exact_lengths(tokenizer) -> None:
    make = TextMaker(tokenizer, random.Random(0))
    for n in (1, 2, 17, 300):
        assert _count(tokenizer, make.text(n)) == n
    padded = make.pad_to("Header:\n", 40)
    assert padded.startswith("Header:\n") and _count(tokenizer, padded) == 40
    with pytest.raises(ValueError):
        make.pad_to("a much longer header than two tokens", 2)


def test_agent_sessions(tokenizer) -> None:
    w = agent_workload(
        tokenizer,
        num_agents=3,
        turns=4,
        system_len=400,
        task_len=20,
        tool_result_len=50,
        output_len=8,
        seed=1,
    )
    assert w.name == "agent" and w.num_requests == 12 and len(w.sessions) == 3
    systems = {s.turns[0].messages[0]["content"] for s in w.sessions}
    assert len(systems) == 1  # one system prompt shared by every agent
    (system,) = systems
    assert _count(tokenizer, system) == 400 and "run_tests" in system
    tasks = {s.turns[0].messages[1]["content"] for s in w.sessions}
    assert len(tasks) == 3
    for s in w.sessions:
        first, *later = s.turns
        assert [m["role"] for m in first.messages] == ["system", "user"]
        assert first.new_tokens == 400 + _count(tokenizer, first.messages[1]["content"])
        for turn in later:
            (msg,) = turn.messages
            assert msg["role"] == "user" and turn.max_tokens == 8
            assert turn.new_tokens == _count(tokenizer, msg["content"])
            # The tool result alone is tool_result_len tokens; the frame adds a few.
            assert 50 < turn.new_tokens < 80
    again = agent_workload(
        tokenizer,
        num_agents=3,
        turns=4,
        system_len=400,
        task_len=20,
        tool_result_len=50,
        output_len=8,
        seed=1,
    )
    assert again.sessions == w.sessions


def test_shared_prefix_groups(tokenizer) -> None:
    w = shared_prefix_workload(
        tokenizer,
        num_groups=3,
        prompts_per_group=4,
        system_len=30,
        question_len=10,
        output_len=5,
        seed=2,
    )
    assert w.num_requests == 12
    assert [s.session_id for s in w.sessions] == list(range(12))
    by_group: dict[int, set[str]] = {}
    for s in w.sessions:
        system, question = (m["content"] for m in s.turns[0].messages)
        assert _count(tokenizer, system) == 30 and _count(tokenizer, question) == 10
        by_group.setdefault(s.group, set()).add(system)
    assert sorted(by_group) == [0, 1, 2]
    assert all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == 3
    # Shuffled: not grouped in order.
    assert [s.group for s in w.sessions] != sorted(s.group for s in w.sessions)


def test_random_lengths_and_completion_prompt(tokenizer) -> None:
    w = random_workload(tokenizer, num_prompts=5, input_len=33, output_len=4, seed=5)
    for s in w.sessions:
        (turn,) = s.turns
        assert _count(tokenizer, completion_prompt(turn.messages)) == 33
        assert turn.max_tokens == 4
    assert completion_prompt([{"content": "a"}, {"content": "b"}]) == "a\n\nb"


def test_poisson_and_gamma_arrivals() -> None:
    n = 40_000
    for burstiness in (1.0, 4.0):
        t = np.asarray(arrival_offsets(n, rate=20.0, burstiness=burstiness, seed=7))
        gaps = np.diff(t, prepend=0.0)
        assert np.all(gaps >= 0)
        # Gamma(k, 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k).
        assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.03)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)
    assert arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 5.0, seed=1) == arrival_offsets(4, 5.0, seed=1)
    for rate, b in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_offsets(2, rate, b)


def test_workload_from_args_builds_the_named_workload(tokenizer) -> None:
    # `flashserve bench` and bench/disagg.py pass their parsed options; the result is
    # the workload the direct call with the same numbers builds.
    args = argparse.Namespace(
        workload="shared-prefix",
        num_groups=2,
        prompts_per_group=3,
        system_len=40,
        question_len=8,
        output_len=4,
        seed=5,
    )
    built = workload_from_args(args, tokenizer)
    direct = shared_prefix_workload(
        tokenizer,
        num_groups=2,
        prompts_per_group=3,
        system_len=40,
        question_len=8,
        output_len=4,
        seed=5,
    )
    assert built.name == "shared-prefix" and built.num_requests == 6
    assert built.params == direct.params
    assert [t.messages for s in built.sessions for t in s.turns] == [
        t.messages for s in direct.sessions for t in s.turns
    ]
    args = argparse.Namespace(workload="random", num_prompts=3, input_len=16, output_len=2, seed=1)
    assert workload_from_args(args, tokenizer).num_requests == 3
