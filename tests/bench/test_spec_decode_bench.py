"""bench/spec_decode.py's pieces that need no speculative engine: the greedy-verify
replay of the ngram proposer (hand-computed), vLLM's acceptance figures, the workloads
and the arguments."""

from __future__ import annotations

import pytest

from bench import spec_decode
from engine.spec_decode.config import SpeculativeConfig


def test_replay_of_greedy_verification_by_hand() -> None:
    # full = 5 6 7 8 | 5 6 7 9 5 6; the prefill gave the first 5.
    # Step 1: tail [5] occurred at 0, draft [6, 7] (k 2), both right: commit 6 7 9.
    # Step 2: tail [9] never occurred: no draft, commit 5.  Step 3: room 1, K 0: commit 6.
    sim = spec_decode.simulate_ngram([5, 6, 7, 8], [5, 6, 7, 9, 5, 6], k=2, occurrence="earliest")
    assert sim == {
        "drafts": 1,
        "draft_tokens": 2,
        "accepted": 2,
        "per_pos": [1, 1],
        "steps": 3,
        "tokens": 5,
    }
    figures = spec_decode.simulated_acceptance([sim])
    assert figures["mean_acceptance_length"] == 3.0
    assert figures["acceptance_rate"] == 1.0
    assert figures["per_position"] == [1.0, 1.0]
    assert figures["steps_ratio"] == pytest.approx(5 / 3)


def test_replay_rejects_at_the_first_wrong_draft() -> None:
    # 1 2 3 | 1 2 4: the prefill gave 1; two tokens of room cap K at 1, so the draft
    # after the tail [1] is [2]: right; 4 is the model's own token.
    sim = spec_decode.simulate_ngram([1, 2, 3], [1, 2, 4], k=2, occurrence="earliest")
    assert (sim["drafts"], sim["draft_tokens"], sim["accepted"], sim["per_pos"]) == (
        1,
        1,
        1,
        [1, 0],
    )
    assert sim["steps"] == 1
    # K 3 and more room: the draft [2, 3] is right, then wrong (the model said 4).
    sim = spec_decode.simulate_ngram([1, 2, 3], [1, 2, 4, 4, 4], k=3, occurrence="earliest")
    assert (sim["draft_tokens"], sim["accepted"], sim["per_pos"][:2]) == (3, 1, [1, 0])


def test_acceptance_figures_are_vllms() -> None:
    a = spec_decode.acceptance(drafts=4, draft_tokens=10, accepted=6, per_pos=[3, 2, 1])
    assert a["mean_acceptance_length"] == 2.5
    assert a["acceptance_rate"] == 0.6
    assert a["per_position"] == [0.75, 0.5, 0.25]
    assert spec_decode.acceptance(0, 0, 0, [])["mean_acceptance_length"] == 1.0


def test_workloads_differ_per_request_and_json_edit_repeats_its_schemas() -> None:
    texts = spec_decode.workload_texts("json-edit", 3)
    assert len(set(texts)) == 3
    first_line = texts[0].split("\n\n")[1].splitlines()[0]
    assert texts[0].endswith(first_line[:40])  # the copy has begun: prompt lookup's case
    assert len(set(spec_decode.workload_texts("verse", 2))) == 2
    calls = spec_decode.workload_texts("tool-call", 3)
    assert len(set(calls)) == 3 and all(
        t.endswith(("<｜Assistant｜></think>", "<｜Assistant｜><think>")) for t in calls
    )
    assert all("parameter schemas" in t for t in calls)


def test_arguments() -> None:
    args = spec_decode.parse_args([])
    assert (args.methods, args.k, args.batches) == (["ngram"], 4, [1, 8, 32])
    assert spec_decode.spec_json("dspark", 4) == '{"method": "dspark", "num_speculative_tokens": 4}'
    paused = spec_decode.spec_json("ngram", 3, max_batch_size=16)
    assert SpeculativeConfig.parse(paused) == SpeculativeConfig("ngram", 3, max_batch_size=16)
    with pytest.raises(SystemExit):
        spec_decode.parse_args(["--k", "0"])
