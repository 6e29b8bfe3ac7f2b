"""A heavy schema (61 required strings, each with a counted-repetition pattern) crosses
to the engine core as its text and compiles off the step loop: another stream keeps
decoding while it compiles.

Before the engine compiled specs itself, the server compiled the grammar and pickled
it into the request message for the core: for this schema about 300 MB and 24 s,
during which every other stream stopped.
"""

from __future__ import annotations

import time

import pytest
from engine_helpers import fake_engine, greedy

from engine.api import core_protocol as wire
from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.loader.tokenizer import load_tokenizer
from server.chat.structured_output import structured_output_spec
from server.openai.protocol import ResponseFormat

VOCAB = 129280
PATTERN = "^(a|b|c|d|e|f|g|h){1,50}(x|y|z){2,40}[0-9]{3,30}$"
HEAVY = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "pattern": PATTERN} for i in range(61)},
    "required": [f"p{i}" for i in range(61)],
}
# A step of the fake engine takes milliseconds; a stall is a step that waits on the grammar.
MAX_GAP_S = 1.0


def heavy_params() -> SamplingParams:
    fmt = {"type": "json_schema", "json_schema": {"name": "heavy", "schema": HEAVY}}
    spec = structured_output_spec(1 << 20, response_format=ResponseFormat.model_validate(fmt))
    assert spec is not None
    return SamplingParams(max_tokens=4, structured=spec)


def test_the_heavy_schema_crosses_to_the_core_as_a_few_kb() -> None:
    data = wire.ENCODER.encode(wire.add_msg(Request("heavy", [1, 2, 3], heavy_params())))
    assert len(data) < 16 << 10, len(data)
    decoded = wire.request_of(wire.TO_CORE.decode(data))
    assert decoded.sampling_params.structured == heavy_params().structured


@pytest.mark.timeout(120)
def test_a_running_stream_keeps_decoding_while_a_heavy_grammar_compiles() -> None:
    def slow_token(seq) -> int:  # a step of about 5 ms: the stream outlives the compile
        time.sleep(0.005)
        return (seq.num_tokens * 7) % 61 + 3

    engine, _ = fake_engine(
        vocab_size=VOCAB, num_pages=1024, next_token=slow_token, tokenizer=load_tokenizer()
    )
    engine.add_request(Request("running", list(range(3, 20)), greedy(8000)))
    while not any(o.request_id == "running" and o.outputs for o in engine.step()):
        pass
    engine.add_request(Request("heavy", list(range(5, 30)), heavy_params()))
    gaps, ready, last = [], False, time.perf_counter()
    while not ready:
        outputs = engine.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        running = [o for o in outputs if o.request_id == "running"]
        assert running and not running[-1].finished, "the stream ended before the grammar"
        ready = any(o.request_id == "heavy" for o in outputs)
        heavy = [o for o in outputs if o.request_id == "heavy"]
        assert all(o.error is None for o in heavy)
    assert len(gaps) > 1  # it compiled while the stream ran, not in one step
    assert max(gaps) < MAX_GAP_S, max(gaps)
    engine.close()
