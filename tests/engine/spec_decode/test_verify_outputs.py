"""What a verify step reports: stop strings, stop tokens and grammars cut the committed
tokens where plain decoding stops; the flag, the proposer build and the counters'
trip to the API process."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
import torch
from engine_helpers import TINY, greedy, prompt, run_to_completion, token_stream
from spec_helpers import K, ScriptedProposer, make_engine, spec_config

from engine.api.core_protocol import ENCODER, FROM_CORE, StepMsg
from engine.api.request import Request
from engine.api.sampling_params import SamplingParams, StructuredOutputSpec
from engine.config import EngineConfig
from engine.core.llm_engine import EngineCounters, EngineStats
from engine.loader.tokenizer import load_tokenizer
from engine.model.base import CausalLM
from engine.spec_decode.build import NO_DRAFTER, build_proposer
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.dspark_proposer import DSparkProposer
from kvstore.stats import KVStats

PROMPT = prompt(19, 21)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


class LadderGrammar:
    """A grammar with a known answer: the ``i``-th token must be ``≡ i (mod 5)`` and the
    answer is complete after ``length`` tokens. ``accept`` of any other token raises,
    so a mask computed from a stale parse state, or a rejected draft fed to the
    matcher, fails the request."""

    def __init__(self, vocab: int, length: int) -> None:
        self.vocab, self.length, self.accepted = vocab, length, 0

    def allowed_tokens(self) -> torch.Tensor:
        return torch.arange(self.vocab) % 5 == self.accepted % 5

    def accept(self, token_id: int) -> None:
        if token_id % 5 != self.accepted % 5 or self.is_terminated():
            raise AssertionError(f"token {token_id} is not allowed at {self.accepted}")
        self.accepted += 1

    def is_terminated(self) -> bool:
        return self.accepted >= self.length


class LadderBackend:
    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.matchers: list[LadderGrammar] = []

    def submit(self, spec: StructuredOutputSpec):
        backend, length = self, int(spec.json_schema or "0")

        class Job:
            def ready(self, now: float) -> bool:
                return True

            def matcher(self) -> LadderGrammar:
                backend.matchers.append(LadderGrammar(backend.vocab, length))
                return backend.matchers[-1]

            def cancel(self) -> None:
                pass

            def wait(self, timeout: float) -> None:
                pass

        return Job()

    def warm(self) -> None:
        pass

    def close(self) -> None:
        pass


def run(model, tokenizer, requests: dict[str, SamplingParams], proposer=None):
    """Every request on ``PROMPT``, to completion; (engine, outputs by id, grammars)."""
    backend = LadderBackend(TINY.vocab_size)
    engine, _, _ = make_engine(model, "paged", proposer, tokenizer=tokenizer, grammars=backend)
    for rid, params in requests.items():
        engine.add_request(Request(rid, PROMPT, params))
    return engine, run_to_completion(engine), backend


def text(outputs) -> str:
    return "".join(c.text for o in outputs for c in o.outputs)


def test_stops_and_grammars_cut_inside_accepted_drafts(engine_model64, tokenizer):
    """A stop string first seen in token 5's text or later, token 6 as a stop token,
    and a grammar complete after 9 tokens, each ending the plain stream early. The
    speculative run drafts the stream past each stop ("oracle": the drafts are all
    right, so a stop lands inside the accepted drafts; under the grammar, "mixed":
    wrong drafts break the ladder, so a mask from a stale parse state or a rejected
    draft fed to the matcher would fail the request) and must stop at the same token
    with the same text, reason and usage."""
    stream = token_stream(run(engine_model64, tokenizer, {"free": greedy(12)})[1]["free"])
    full, head = tokenizer.decode(stream), tokenizer.decode(stream[:5])
    stop = next(
        full[i : i + 2] for i in range(len(head), len(full) - 1) if full.find(full[i : i + 2]) == i
    )
    assert stream.index(stream[6]) == 6
    requests = {
        "string": greedy(12, stop=[stop], include_stop_str_in_output=True),
        "token": SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stream[6]]),
        "grammar": SamplingParams(
            temperature=0.0, max_tokens=12, structured=StructuredOutputSpec(json_schema="9")
        ),
    }
    _, plain, _ = run(engine_model64, tokenizer, requests)
    streams = {(rid, 0): PROMPT + stream for rid in ("string", "token")}
    streams["grammar", 0] = PROMPT + token_stream(plain["grammar"])
    modes = {"string": "oracle", "token": "oracle", "grammar": "mixed"}
    engine, spec, grammars = run(
        engine_model64, tokenizer, requests, ScriptedProposer(streams, modes)
    )
    assert len(token_stream(plain["grammar"])) == 9
    for rid in requests:
        p_out, s_out = plain[rid], spec[rid]
        assert p_out[-1].outputs[-1].finish_reason == "stop"
        assert 5 <= len(token_stream(p_out)) < 12
        assert token_stream(s_out) == token_stream(p_out)
        assert text(s_out) == text(p_out)
        assert s_out[-1].outputs[-1].finish_reason == "stop"
        assert s_out[-1].outputs[-1].stop_reason == p_out[-1].outputs[-1].stop_reason
        assert s_out[-1].usage == p_out[-1].usage
    (matcher,) = grammars.matchers
    assert matcher.accepted == 9 and matcher.is_terminated()
    assert engine.counters.spec_accepted_tokens > 0
    assert engine.kv.stats().device_pages_in_use == 0


# ----------------------------------------------------------------- configuration


def test_the_flag_parses_and_refuses_what_cannot_run():
    cfg = EngineConfig(speculative_config=spec_config(2, max_batch_size=8))
    assert cfg.speculative() == SpeculativeConfig("ngram", 2, max_batch_size=8)
    assert EngineConfig().speculative() is None
    with pytest.raises(ValueError, match="not JSON"):
        EngineConfig(speculative_config="{method: ngram}")
    with pytest.raises(ValueError, match="unknown keys"):
        EngineConfig(speculative_config=spec_config(2, draft_model="x"))
    # Served on worker ranks too (tests/engine/test_parallel_speculation.py).
    parallel = EngineConfig(speculative_config=spec_config(2), tensor_parallel_size=2)
    assert parallel.speculative() == SpeculativeConfig("ngram", 2)


def test_a_checkpoint_without_a_drafter_is_refused(engine_model):
    spec = SpeculativeConfig("dspark", 3)
    assert engine_model.dspark is not None  # the tiny model carries a random drafter
    assert isinstance(build_proposer(spec, engine_model), DSparkProposer)
    text_only = cast(CausalLM, SimpleNamespace(dspark=None))
    with pytest.raises(ValueError, match=r"no DSpark drafter \(mtp\.\*\)"):
        build_proposer(spec, text_only)
    assert NO_DRAFTER == "this checkpoint has no DSpark drafter (mtp.*)"


def test_an_engine_needs_a_proposer_and_drafts_below_the_window(engine_model):
    with pytest.raises(ValueError, match="no proposer"):
        make_engine(engine_model, "paged", None, speculative_config=spec_config())
    assert TINY.sliding_window == 16  # each verify row needs a ring slot of its own
    proposer = ScriptedProposer({}, {})
    make_engine(engine_model, "paged", proposer, speculative_config=spec_config(15))
    with pytest.raises(ValueError, match="below the sliding window"):
        make_engine(engine_model, "paged", proposer, speculative_config=spec_config(16))


def test_spec_counters_travel_with_the_stats():
    counters = EngineCounters(
        spec_drafts=7, spec_draft_tokens=21, spec_accepted_tokens=9, spec_accepted_per_pos=[5, 3, 1]
    )
    kv = KVStats(page_tokens=8)
    msg = StepMsg(outputs=[], stats=EngineStats(1, 0, 0, kv, counters), applied_seqs=0)
    back = FROM_CORE.decode(ENCODER.encode(msg))
    assert isinstance(back, StepMsg)
    got = back.stats.counters
    assert (got.spec_drafts, got.spec_draft_tokens, got.spec_accepted_tokens) == (7, 21, 9)
    assert got.spec_accepted_per_pos == [5, 3, 1] and K == 3
