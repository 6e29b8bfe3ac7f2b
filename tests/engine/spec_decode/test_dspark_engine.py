"""The DSpark proposer inside the engine: the tiny model's random drafter drafts every
decode from the block inputs the paged runner captures, the verify step checks the
drafts, and the output is the plain run's token for token (float64)."""

from __future__ import annotations

import json
from itertools import pairwise

from engine_helpers import greedy, prompt, run_to_completion, token_stream
from spec_helpers import make_engine

from engine.api.request import Request
from engine.spec_decode.build import build_proposer
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.dspark_proposer import DSparkProposer

K = 3


def test_the_tiny_drafter_drafts_every_step_and_changes_no_token(engine_model64):
    model = engine_model64
    spec = SpeculativeConfig("dspark", K)
    # Without the rejection backoff, which would pause a random drafter's rounds.
    proposer = DSparkProposer(model, spec, backoff=False)
    assert proposer.hidden_layers == tuple(model.config.dspark_target_layer_ids)
    flag = json.dumps({"method": "dspark", "num_speculative_tokens": K})
    plain, _, _ = make_engine(model, "paged", prefill_chunk_tokens=16)
    fast, recorder, _ = make_engine(
        model, "paged", proposer, speculative_config=flag, prefill_chunk_tokens=16
    )
    prompts = {"a": prompt(37, 5), "b": prompt(20, 6)}
    streams = []
    for engine in (plain, fast):
        for rid, ids in prompts.items():
            engine.add_request(Request(rid, ids, greedy(10)))
        outputs = run_to_completion(engine)
        streams.append({rid: token_stream(outputs[rid]) for rid in prompts})
    assert streams[0] == streams[1]
    counters = fast.stats().counters
    # Every decode after the first drafts (the drafter needs a committed row of context),
    # K tokens unless the room left under max_tokens caps it.
    assert counters.spec_drafts >= 2 * 8
    assert counters.spec_drafts < counters.spec_draft_tokens <= K * counters.spec_drafts
    assert 0 <= counters.spec_accepted_tokens <= counters.spec_draft_tokens
    per_pos = counters.spec_accepted_per_pos
    assert len(per_pos) == K and all(a >= b for a, b in pairwise(per_pos))
    assert any(row.drafts == K for rows in recorder.rows.values() for row in rows)
    fast.close()


def _plain_and_speculative(model, flag: str, max_tokens: int):
    """One request greedy through a plain engine and through one built from ``flag``:
    both token streams, the speculative engine's counters and its recorded rows."""
    proposer = build_proposer(SpeculativeConfig.parse(flag), model)
    plain, _, _ = make_engine(model, "paged", prefill_chunk_tokens=16)
    fast, recorder, _ = make_engine(
        model, "paged", proposer, speculative_config=flag, prefill_chunk_tokens=16
    )
    streams = []
    for engine in (plain, fast):
        engine.add_request(Request("a", prompt(37, 5), greedy(max_tokens)))
        streams.append(token_stream(run_to_completion(engine)["a"]))
    counters = fast.stats().counters
    fast.close()
    plain.close()
    return streams, counters, recorder, proposer


def test_min_confidence_one_cuts_every_draft_and_changes_no_token(engine_model64):
    """``min_confidence`` from the flag reaches the proposer: at 1.0 no sigmoid
    confidence reaches it, so every round is cut to no draft, no verify row is spent,
    and the tokens are the plain run's."""
    flag = json.dumps({"method": "dspark", "num_speculative_tokens": K, "min_confidence": 1.0})
    streams, counters, recorder, proposer = _plain_and_speculative(engine_model64, flag, 8)
    assert proposer.min_confidence == 1.0
    assert streams[0] == streams[1]
    assert counters.spec_draft_tokens == 0 and counters.spec_accepted_tokens == 0
    assert all(row.drafts == 0 for rows in recorder.rows.values() for row in rows)


def test_a_rejected_drafter_backs_off_and_changes_no_token(engine_model64):
    """The built proposer (backoff on) with the random drafter, whose first drafts are
    all but always rejected: fewer rounds than decode steps, the plain run's tokens."""
    flag = json.dumps({"method": "dspark", "num_speculative_tokens": K})
    streams, counters, _, _ = _plain_and_speculative(engine_model64, flag, 16)
    assert streams[0] == streams[1]
    accepted_first = counters.spec_accepted_per_pos[0] if counters.spec_accepted_per_pos else 0
    # 15 decodes after the first token; two misses start a pause of 2, then 4, 8...
    assert accepted_first == 0, "the random drafter's first draft was taken: no backoff to see"
    assert 2 <= counters.spec_drafts < 15 - 6
