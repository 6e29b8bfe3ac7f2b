"""Demo tool-call conversations: arguments valid against their schemas (jsonschema is the
oracle), and text byte for byte what the server encodes for the same request."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from chat_helpers import parse_tool_calls

from server.chat.chat_encoding import EOS, encode_chat
from server.chat.tool_calls import THINK_END
from server.openai.protocol import ChatCompletionRequest
from training.bpe import EOS_ID, train_bpe
from training.corpus import Play
from training.data import SequenceSampler
from training.tool_data import functions, tool_conversation

REPLIES = ["Now is the winter of our discontent.", "O brave new world,\nThat has such people in't!"]


def _samples(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [tool_conversation(rng, REPLIES) for _ in range(n)]


def test_bank_schemas_are_valid_json_schema() -> None:
    for function in functions():
        jsonschema.Draft202012Validator.check_schema(function["parameters"])


@pytest.mark.parametrize("seed", [0, 1])
def test_conversation_is_the_server_encoding(seed: int) -> None:
    samples = _samples(40, seed)
    assert {s.thinking for s in samples} == {False, True}
    assert any(m["role"] == "tool" for s in samples for m in s.messages)
    assert any(m["role"] == "system" for s in samples for m in s.messages)
    for sample in samples:
        tools = [{"type": "function", "function": f} for f in sample.functions]
        request = ChatCompletionRequest.model_validate(
            {"model": "demo", "messages": sample.messages, "tools": tools}
        )
        text = encode_chat(
            request.messages, tools=request.tools, thinking=sample.thinking, reasoning_effort=75
        )
        # The encoder ends with the next assistant turn's header; a sample ends at EOS.
        assert sample.text == text[: text.rindex(EOS) + len(EOS)]


def test_arguments_satisfy_the_schema_and_parse_back() -> None:
    for sample in _samples(60):
        (function,) = [f for f in sample.functions if f["name"] == sample.name]
        jsonschema.validate(sample.arguments, function["parameters"])
        # The call the model is trained to write parses back to the same arguments.
        turn = sample.text.split("<｜Assistant｜>")[1].split(EOS)[0]
        output = turn.split(THINK_END)[-1]  # what follows the (empty) reasoning
        assert output.startswith("\n\n<｜DSML｜ calls>")
        (call,) = parse_tool_calls(output).tool_calls
        assert call.name == sample.name
        assert json.loads(call.arguments) == sample.arguments


def test_sampler_tool_sequences_end_at_a_conversation_end() -> None:
    """With tool_fraction 1 every sequence is seq_len + 1 tokens cut so that it ends with
    the EOS of a conversation, and holds a whole DSML call before that EOS."""
    play = Play("p", "P", "Ber.\nWho's there?\n\nFran.\nNay, answer me.\n\n" * 20)
    rng = random.Random(5)
    texts = [play.text] + [tool_conversation(rng, REPLIES).text for _ in range(20)]
    tokenizer = train_bpe(texts, 600)
    sampler = SequenceSampler(tokenizer, [play], 96, 0.0, 0, tool_fraction=1.0)
    for _ in range(4):
        ids = sampler.sample()
        assert len(ids) == 97 and int(ids[-1]) == EOS_ID
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=False)
        assert text.removesuffix(EOS).endswith("</｜DSML｜ calls>") or "</tool_result>" in text
