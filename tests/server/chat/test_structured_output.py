"""Grammar-constrained decoding: random sampling under the mask always yields valid output.

Each grammar takes the request path: the API fields become the server's
``StructuredOutputSpec``, which the engine's ``StructuredOutputManager``
compiles into a matcher; errors are answered as the server answers them.

Each run samples from random logits over the real 129,280-token vocabulary,
restricted to the allowed tokens. Random text rarely closes a JSON string on its
own, so now and then (and always after a step budget) a "closer" picks an
allowed token that ends structures sooner. Every picked token is allowed by the
mask, so any invalid output would be the grammar's fault.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from chat_helpers import bitmask_to_bool, parse_tool_calls, split_reasoning

from engine.api.errors import GrammarError
from engine.loader.tokenizer import load_tokenizer
from engine.sample.sampler import allowed_token_mask
from engine.structured_output.xgrammar_backend import StructuredOutputManager, XGrammarMatcher
from server.chat.structured_output import structured_output_spec
from server.chat.tool_calls import render_tool_calls
from server.http.errors import APIError, from_engine_error
from server.openai.protocol import ChatCompletionRequest
from server.settings import ServerSettings

VOCAB = 129280
EOS = 1
# '"' first: inside a JSON string "}" and "]" are text, and would never close it.
CLOSERS = ["</think>", '"', "}", "]", "</", "｜DSML｜"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["zip"],
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "address"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 4}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


class Compiler:
    """API fields -> the server's spec -> the engine's matcher (or the server's error)."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager

    def for_request(self, **fields) -> XGrammarMatcher | None:
        spec = structured_output_spec(ServerSettings().max_grammar_schema_bytes, **fields)
        if spec is None:
            return None
        try:
            return self.manager.matcher_now(spec)
        except GrammarError as exc:
            raise from_engine_error(exc) from exc


@pytest.fixture(scope="module")
def compiler(tokenizer):
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS)
    yield Compiler(manager)
    manager.close()


@pytest.fixture(scope="module")
def closer(tokenizer):
    """Pick an allowed token that ends structures: EOS, then CLOSERS, then the shortest.

    ``</think>`` is preferred only while reasoning: JSON strings may contain it
    as text, and preferring it there would never close the string.
    """
    preferred = [EOS] + [tokenizer.token_to_id(s) for s in CLOSERS]
    assert None not in preferred
    think_end = preferred[1]
    lengths = np.full(VOCAB, 10_000, dtype=np.int64)
    for i in tokenizer.get_vocab(with_added_tokens=True).values():
        lengths[i] = len(tokenizer.decode([i], skip_special_tokens=False)) or 10_000

    def pick(mask: np.ndarray, reasoning: bool) -> int:
        for i in preferred:
            if mask[i] and (reasoning or i != think_end):
                return i
        return int(np.where(mask, lengths, 10_000).argmin())

    return pick


def request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "deepseek-flash", "messages": [{"role": "user", "content": "q"}], **body}
    )


def sample(
    provider, closer, tokenizer, seed: int, *, thinking: bool = False, budget: int = 120
) -> str:
    """Sample until the grammar terminates (it must, within 400 steps); the text before EOS.

    Random steps draw from softmax(random logits) over the allowed tokens, by
    the Gumbel-max trick.
    """
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    reasoning = thinking
    for step in range(400):
        mask = bitmask_to_bool(provider.allowed_tokens(), VOCAB).numpy()
        assert mask.any()
        if step >= budget or rng.random() < 0.25:
            token = closer(mask, reasoning)
        else:
            scores = rng.standard_normal(VOCAB) + rng.gumbel(size=VOCAB)
            token = int(np.where(mask, scores, -np.inf).argmax())
        assert mask[token]
        provider.accept(token)
        ids.append(token)
        reasoning = reasoning and token != 128822
        if provider.is_terminated():
            assert token == EOS  # EOS only once the grammar is complete
            return tokenizer.decode(ids[:-1], skip_special_tokens=False)
    raise AssertionError("the grammar did not terminate: " + tokenizer.decode(ids)[-300:])


def test_bitmask_expansion_against_bit_arithmetic() -> None:
    words = torch.tensor([0b1011, -(2**31), 1], dtype=torch.int32)
    allowed = bitmask_to_bool(words, 70)
    expected = [i for i in range(70) if (int(words[i // 32]) >> (i % 32)) & 1]
    assert torch.nonzero(allowed).flatten().tolist() == expected == [0, 1, 3, 63, 64]


def test_masks_read_the_same_in_the_engine_sampler(compiler) -> None:
    # The engine expands the provider's int32 bitmask with its own code path.
    fmt = request(response_format={"type": "json_object"}).response_format
    provider = compiler.for_request(response_format=fmt)
    assert provider.accept_text('{"k":"v')
    bitmask = provider.allowed_tokens()
    assert bitmask.dtype == torch.int32 and bitmask.shape == ((VOCAB + 31) // 32,)
    ours = bitmask_to_bool(bitmask, VOCAB)
    assert torch.equal(ours, allowed_token_mask(bitmask, VOCAB))
    assert 1000 < int(ours.sum()) < VOCAB  # string content: most tokens, not all


@pytest.mark.parametrize("seed", range(3))
def test_json_object_always_parses(compiler, closer, tokenizer, seed: int) -> None:
    provider = compiler.for_request(
        response_format=request(response_format={"type": "json_object"}).response_format
    )
    value = json.loads(sample(provider, closer, tokenizer, seed))
    assert isinstance(value, dict)


@pytest.mark.parametrize(("seed", "thinking"), [(0, False), (1, False), (2, False), (3, True)])
def test_json_schema_always_validates(
    compiler, closer, tokenizer, seed: int, thinking: bool
) -> None:
    fmt = request(
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    ).response_format
    provider = compiler.for_request(response_format=fmt, starts_in_reasoning=thinking)
    _, content = split_reasoning(
        sample(provider, closer, tokenizer, seed, thinking=thinking), starts_in_reasoning=thinking
    )
    jsonschema.validate(json.loads(content), SCHEMA)


def test_special_tokens_are_masked_and_eos_waits_for_the_end(compiler) -> None:
    provider = compiler.for_request(
        response_format=request(response_format={"type": "json_object"}).response_format
    )
    mask = bitmask_to_bool(provider.allowed_tokens(), VOCAB)
    for token_id in (0, EOS, 2, 128803, 128804, 128821, 128822, 128825, 128800):
        assert not mask[token_id], token_id
    assert provider.accept_text('{"a":[1,"x"]}')
    assert provider.is_completed() and not provider.is_terminated()
    mask = bitmask_to_bool(provider.allowed_tokens(), VOCAB)
    assert mask[EOS]
    provider.accept(EOS)
    assert provider.is_terminated()
    with pytest.raises(ValueError):
        provider.accept(EOS)


def check_calls(text: str, tools: list[dict], *, thinking: bool) -> list[tuple[str, dict]]:
    _, content = split_reasoning(text, starts_in_reasoning=thinking)
    parsed = parse_tool_calls(content)
    assert parsed.content == ""
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = []
    for call in parsed.tool_calls:
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, by_name[call.name])
        calls.append((call.name, arguments))
    return calls


@pytest.mark.parametrize(("seed", "thinking"), [(0, False), (1, False), (2, True)])
def test_named_tool_choice_forces_one_valid_call(
    compiler, closer, tokenizer, seed, thinking
) -> None:
    r = request(
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    provider = compiler.for_request(
        tools=r.tools, tool_choice=r.tool_choice, starts_in_reasoning=thinking
    )
    calls = check_calls(
        sample(provider, closer, tokenizer, seed, thinking=thinking),
        [WEATHER, CLOCK],
        thinking=thinking,
    )
    assert [name for name, _ in calls] == ["get_weather"]


def test_a_function_without_parameters_takes_no_arguments(compiler) -> None:
    # OpenAI: omitting `parameters` defines an empty parameter list (xgrammar alone
    # would accept any arguments).
    ping = {"type": "function", "function": {"name": "ping"}}
    choice = {"type": "function", "function": {"name": "ping"}}
    r = request(tools=[ping], tool_choice=choice)
    head = '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="ping">\n'
    tail = "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    empty = compiler.for_request(tools=r.tools, tool_choice=r.tool_choice)
    assert empty.accept_text(head + tail) and empty.is_completed()
    with_argument = compiler.for_request(tools=r.tools, tool_choice=r.tool_choice)
    assert with_argument.accept_text(head)
    assert not with_argument.accept_text('<｜DSML｜ parameter name="x" string="true">')


@pytest.mark.parametrize(("seed", "thinking"), [(0, False), (1, True)])
def test_required_tool_choice_forces_valid_calls(
    compiler, closer, tokenizer, seed, thinking
) -> None:
    r = request(tools=[WEATHER, CLOCK], tool_choice="required")
    provider = compiler.for_request(
        tools=r.tools, tool_choice=r.tool_choice, starts_in_reasoning=thinking
    )
    calls = check_calls(
        sample(provider, closer, tokenizer, seed, thinking=thinking),
        [WEATHER, CLOCK],
        thinking=thinking,
    )
    assert len(calls) >= 1
    assert {name for name, _ in calls} <= {"get_weather", "get_time"}


@pytest.mark.parametrize("seed", range(3))
def test_json_with_auto_tools_is_json_or_calls(compiler, closer, tokenizer, seed: int) -> None:
    r = request(tools=[WEATHER], response_format={"type": "json_object"})
    provider = compiler.for_request(
        response_format=r.response_format, tools=r.tools, tool_choice=r.effective_tool_choice
    )
    text = sample(provider, closer, tokenizer, seed, budget=20)
    if "<｜DSML｜ calls>" in text:
        assert len(check_calls(text, [WEATHER], thinking=False)) >= 1
    else:
        assert isinstance(json.loads(text), dict)


def test_json_with_auto_tools_can_take_the_calls_branch(compiler, closer, tokenizer) -> None:
    r = request(tools=[WEATHER], response_format={"type": "json_object"})
    provider = compiler.for_request(
        response_format=r.response_format,
        tools=r.tools,
        tool_choice="auto",
        prefix="\n\n<｜DSML｜ calls>\n",
    )
    text = "\n\n<｜DSML｜ calls>\n" + sample(provider, closer, tokenizer, 5)
    names = [name for name, _ in check_calls(text, [WEATHER], thinking=False)]
    assert names and set(names) == {"get_weather"}


def test_nothing_to_enforce_gives_no_provider(compiler) -> None:
    r = request(tools=[WEATHER])
    assert compiler.for_request() is None
    assert compiler.for_request(tools=r.tools, tool_choice="none") is None
    fmt = request(response_format={"type": "text"}).response_format
    assert compiler.for_request(response_format=fmt) is None


def test_prefix_must_fit_the_format(compiler) -> None:
    fmt = request(
        response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    ).response_format
    provider = compiler.for_request(response_format=fmt, prefix='{"name":"Al')
    assert provider is not None and not provider.is_completed()
    with pytest.raises(APIError) as info:
        compiler.for_request(response_format=fmt, prefix="Sure! ")
    assert info.value.status == 400


def test_a_bad_schema_is_a_400_naming_the_field(compiler) -> None:
    fmt = request(
        response_format={"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}
    ).response_format
    with pytest.raises(APIError) as info:
        compiler.for_request(response_format=fmt)
    assert info.value.status == 400 and info.value.param == "response_format"


def test_json_output_is_compact(compiler) -> None:
    fmt = request(response_format={"type": "json_object"}).response_format
    for text in ('{ "a":1}', '{"a": 1}', '{"a":1 }', '{"a":[1, 2]}', '\n{"a":1}'):
        assert not compiler.for_request(response_format=fmt).accept_text(text), text
    assert compiler.for_request(response_format=fmt).accept_text('{"a":[1,2],"b":{"c":"d e"}}')


# The calls block as V4.1 writes it (render_tool_calls is the prompt encoder's own).
CANONICAL_CALL = "\n\n" + render_tool_calls([("get_weather", {"city": "Paris", "days": 3})])


def fresh(compiler, tool_choice="required", parallel=True):
    r = request(tools=[WEATHER, CLOCK], tool_choice=tool_choice)
    return compiler.for_request(
        tools=r.tools, tool_choice=r.effective_tool_choice, parallel_tool_calls=parallel
    )


def inside_string_value(prefix: str) -> bool:
    """The prefix ends inside a string="true" parameter's value (free text there)."""
    opened = prefix.rfind('string="true">')
    return opened >= 0 and prefix.find("</｜DSML｜ parameter>", opened) < 0


@pytest.mark.parametrize("choice", ["required", "named"])
def test_calls_block_bounds_whitespace_everywhere(compiler, choice: str) -> None:
    """The canonical layout (one newline between tags) is accepted, and nowhere outside
    a string value may a whitespace run grow by two characters beyond it."""
    tool_choice = (
        {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    )
    whole = fresh(compiler, tool_choice)
    assert whole.accept_text(CANONICAL_CALL)
    assert whole.is_completed()
    checked = 0
    for i in range(len(CANONICAL_CALL) + 1):
        prefix = CANONICAL_CALL[:i]
        if inside_string_value(prefix) or prefix[-1:].isspace():
            continue  # free text, or the middle of a run (its start is checked)
        rest = CANONICAL_CALL[i:]
        run = rest[: len(rest) - len(rest.lstrip())]
        for blanks in ("  ", "\n\n", " \n", "\t "):
            provider = fresh(compiler, tool_choice)
            assert provider.accept_text(prefix + run)
            assert not provider.accept_text(blanks), (prefix[-40:], run, blanks)
        checked += 1
    assert checked > 150  # every tag boundary and non-string value position


def test_eos_is_forced_right_after_the_calls_block(compiler) -> None:
    provider = fresh(compiler)
    assert provider.accept_text(CANONICAL_CALL)
    mask = bitmask_to_bool(provider.allowed_tokens(), VOCAB)
    assert mask.nonzero().flatten().tolist() == [EOS]


def test_parallel_tool_calls_off_allows_exactly_one_call(compiler) -> None:
    second = render_tool_calls([("get_time", {"zone": "UTC"})])
    invoke = second[second.index("<｜DSML｜ invoke") :]
    one, two = fresh(compiler, parallel=False), fresh(compiler, parallel=True)
    block = CANONICAL_CALL[: CANONICAL_CALL.index("</｜DSML｜ calls>")]
    assert one.accept_text(block) and two.accept_text(block)
    assert two.accept_text(invoke)  # parallel on: a second call may follow
    assert not one.accept_text("<｜DSML｜ invoke")
    assert one.accept_text("</｜DSML｜ calls>") and one.is_completed()


@pytest.mark.parametrize("seed", range(3))
def test_auto_tool_choice_completes_an_opened_call_under_the_grammar(
    compiler, closer, tokenizer, seed: int
) -> None:
    """With tools and ``auto``, text is free; once the model opens a calls block the
    arguments are held to the schema and the turn ends with the block."""
    r = request(tools=[WEATHER, CLOCK])
    provider = compiler.for_request(tools=r.tools, tool_choice=r.effective_tool_choice)
    assert provider is not None
    assert provider.accept_text("Let me check. ")
    opened = "\n\n<｜DSML｜ calls>\n"
    assert provider.accept_text(opened)
    assert not fresh_auto(compiler).accept_text(opened + '<｜DSML｜ invoke name="nope">')
    text = "Let me check. " + opened + sample(provider, closer, tokenizer, seed)
    content = parse_tool_calls(text).content
    assert content == "Let me check."
    calls = [(c.name, json.loads(c.arguments)) for c in parse_tool_calls(text).tool_calls]
    assert calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for name, arguments in calls:
        jsonschema.validate(arguments, by_name[name])


def fresh_auto(compiler):
    r = request(tools=[WEATHER, CLOCK])
    return compiler.for_request(tools=r.tools, tool_choice=r.effective_tool_choice)


def test_auto_tool_choice_without_a_call_is_free_text(compiler) -> None:
    provider = fresh_auto(compiler)
    assert provider.accept_text("Any   text,\n\n  with blanks { and braces")
    assert provider.is_completed()  # EOS may end a plain answer


def test_the_spec_sent_to_an_engine_core_keeps_its_grammar_and_prefix(compiler, tokenizer) -> None:
    """What crosses to the core process is the spec as data (no compiled grammar): the
    core's matcher, compiled from the decoded spec, allows exactly the same tokens and
    has accepted the prefix."""
    from engine.api import core_protocol as wire
    from engine.api.request import Request
    from engine.api.sampling_params import SamplingParams

    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    spec = structured_output_spec(
        1 << 20, response_format=request(response_format=fmt).response_format, prefix='{"name":"ab'
    )
    assert spec is not None
    data = wire.ENCODER.encode(wire.add_msg(Request("r", [1, 2], SamplingParams(structured=spec))))
    assert len(data) < 1000  # the schema's text and a few fields
    decoded = wire.request_of(wire.TO_CORE.decode(data)).sampling_params.structured
    assert decoded == spec
    original, copy = compiler.manager.matcher_now(spec), compiler.manager.matcher_now(decoded)
    for text in ("", 'c","age":1', "2"):
        for token in tokenizer.encode(text, add_special_tokens=False).ids:
            original.accept(token)
            copy.accept(token)
        assert torch.equal(copy.allowed_tokens(), original.allowed_tokens()), text
    # The prefix was replayed: a second name cannot start, the object goes on after "age".
    assert copy.is_terminated() is False
    for token in tokenizer.encode(',"address":{"zip":"123"}}', add_special_tokens=False).ids:
        copy.accept(token)
    assert copy.is_completed()
