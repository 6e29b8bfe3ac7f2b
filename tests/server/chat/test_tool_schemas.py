"""``check_tool_schemas``: the tool schemas DeepSeek's DSML call format cannot carry.

The oracle for each decision is the serving path itself, minus the check: the
engine's grammar for the schema (xgrammar's V4.1 calls block, compiled as a
forced call of ``f``) and the DSML parser. For every refused schema the grammar
accepts a call that the parser reads back as arguments ``jsonschema`` rejects
(or cannot write the call at all): the schema-invalid ``tool_calls`` the 400
now prevents. For the look-alikes that stay accepted (``>``, ``<``, a newline
in a name; quotes and angle brackets in a value) the grammar's call parses back,
whole and streamed a character at a time, to schema-valid arguments.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from chat_helpers import parse_tool_calls

from engine.loader.tokenizer import load_tokenizer
from engine.structured_output.xgrammar_backend import StructuredOutputManager
from server.chat.structured_output import structured_output_spec
from server.chat.tool_calls import ToolCallParser
from server.chat.tool_schemas import check_tool_schemas
from server.http.errors import APIError
from server.openai.protocol import NamedToolChoice, Tool

VOCAB = 129280
EOS = 1
D = "｜DSML｜"
CLOSE = f"</{D} parameter>"


def obj(props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def call_text(params: list[tuple[str, str, bool]]) -> str:
    """The calls block the forced grammar writes: ``(name, value, is_string)`` per parameter."""
    body = "".join(
        f'<{D} parameter name="{k}" string="{"true" if s else "false"}">{v}{CLOSE}\n'
        for k, v, s in params
    )
    return f'\n\n<{D} calls>\n<{D} invoke name="f">\n{body}</{D} invoke>\n</{D} calls>'


@pytest.fixture(scope="module")
def grammar_accepts():
    """Whether the engine's forced-call grammar for ``parameters`` accepts ``text`` whole."""
    manager = StructuredOutputManager(load_tokenizer(), VOCAB, EOS)

    def accepts(parameters: dict, text: str) -> bool:
        tool = Tool.model_validate({"function": {"name": "f", "parameters": parameters}})
        choice = NamedToolChoice.model_validate({"function": {"name": "f"}})
        spec = structured_output_spec(1 << 20, tools=[tool], tool_choice=choice)
        assert spec is not None
        matcher = manager.matcher_now(spec)
        return matcher.accept_text(text) and matcher.is_completed()

    yield accepts
    manager.close()


def refusal(schemas: list, field: str = "tools[{i}].function.parameters") -> APIError:
    with pytest.raises(APIError) as caught:
        check_tool_schemas(schemas, field)
    error = caught.value
    assert error.status == 400
    body = error.body()["error"]
    assert body["type"] == body["code"] == "invalid_request_error"
    assert body["message"].startswith(f"{body['param']}: ")
    return error


# (case, schema, the call the grammar writes, where the 400 points)
REFUSED = [
    (
        "quote in a name",
        obj({'a"b': {"type": "string", "enum": ["x"]}}),
        call_text([('a"b', "x", True)]),
        'properties.a"b',
    ),
    (
        "close tag as an enum value",
        obj({"q": {"type": "string", "enum": [CLOSE]}}),
        call_text([("q", CLOSE, True)]),
        "properties.q.enum[0]",
    ),
    (
        "close tag as a const",
        obj({"c": {"const": CLOSE}}),
        call_text([("c", CLOSE, True)]),
        "properties.c.const",
    ),
    (
        "close tag spelled by a pattern",
        obj({"p": {"type": "string", "pattern": f"^a{CLOSE}$"}}),
        call_text([("p", "a" + CLOSE, True)]),
        "properties.p.pattern",
    ),
    (
        "not an object schema",
        {"type": "string"},  # read as a call without parameters: ``{}``, not a string
        call_text([]),
        "",
    ),
]


@pytest.mark.parametrize(
    ("schema", "text", "where"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_refused_schemas_are_ones_the_grammar_would_break(
    grammar_accepts, schema: dict, text: str, where: str
) -> None:
    # Without the check: the grammar lets the call through, and its parsed arguments
    # break the schema (or there is no single call to read).
    assert grammar_accepts(schema, text)
    calls = parse_tool_calls(text).tool_calls
    assert len(calls) != 1 or not jsonschema.Draft202012Validator(schema).is_valid(
        json.loads(calls[0].arguments)
    ), calls
    error = refusal([None, schema])
    assert error.param == "tools[1].function.parameters" + (f".{where}" if where else "")


def test_the_marker_in_a_nested_name_is_refused_as_the_grammar_cannot_write_it(
    grammar_accepts,
) -> None:
    key = f"k{CLOSE}"
    schema = obj({"o": obj({key: {"type": "integer"}})})
    assert not grammar_accepts(schema, call_text([("o", json.dumps({key: 1}), False)]))
    error = refusal([schema])
    assert error.param == f"tools[0].function.parameters.properties.o.properties.{key}"


ACCEPTED = [
    ("gt in a name", "c>d", "x"),
    ("lt in a name", "c<d", "x"),
    ("newline in a name", "c\nd", "x"),
    ("quotes and tags in a value", "q", 'say "<b>hi</b>" & <｜end'),
]


@pytest.mark.parametrize(("name", "value"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_look_alikes_stay_accepted_and_round_trip(grammar_accepts, name: str, value: str) -> None:
    schema = obj({name: {"type": "string", "enum": [value]}, "n": {"type": "integer"}})
    check_tool_schemas([schema])  # no error
    text = call_text([(name, value, True), ("n", "7", False)])
    assert grammar_accepts(schema, text)
    expected = {name: value, "n": 7}
    whole = parse_tool_calls(text).tool_calls
    assert [json.loads(c.arguments) for c in whole] == [expected]
    parser = ToolCallParser()
    for ch in text:  # one character a delta: every header arrives in pieces
        parser.feed(ch)
    parser.finish()
    assert [json.loads(c.arguments) for c in parser.tool_calls] == [expected]
    jsonschema.validate(expected, schema)


def test_object_schemas_and_schemas_without_a_type_pass() -> None:
    check_tool_schemas(
        [
            None,
            {},
            {"type": "object"},
            {"type": ["object"]},
            {"anyOf": [{"type": "object"}]},
            # Names and values that only look like DSML; data keywords are not read.
            obj({"html": {"type": "string", "default": CLOSE, "examples": [CLOSE]}}),
        ]
    )


@pytest.mark.parametrize("kind", ["string", "array", ["object", "null"], None])
def test_non_object_parameters_name_the_field(kind) -> None:
    error = refusal([{"type": "object"}, {"type": kind}])
    assert error.param == "tools[1].function.parameters"
    assert f"got type {json.dumps(kind)}" in error.message


def test_every_place_a_name_or_value_hides_is_walked() -> None:
    deep = {
        "type": "object",
        "$defs": {"d": {"properties": {"x": {"anyOf": [{"enum": [1, f"a{D}"]}]}}}},
    }
    assert (
        refusal([deep]).param
        == "tools[0].function.parameters.$defs.d.properties.x.anyOf[0].enum[1]"
    )
    items = {"type": "object", "properties": {"l": {"items": {"required": ['q"']}}}}
    assert refusal([items]).param == "tools[0].function.parameters.properties.l.items.required[0]"


def test_another_api_names_its_own_field() -> None:
    error = refusal([obj({"ok": {}}), obj({'a"b': {}})], "tools[{i}].input_schema")
    assert error.param == 'tools[1].input_schema.properties.a"b'


def test_the_close_tag_in_a_free_string_inside_a_value_is_allowed_and_read_back(
    grammar_accepts,
) -> None:
    """Not a schema problem: the grammar lets any text into a string inside a JSON value,
    so the parser ends a non-string value only at a close tag outside JSON strings."""
    schema = obj({"l": {"type": "array", "items": {"type": "string"}}})
    check_tool_schemas([schema])
    value = [f"a{CLOSE}b"]
    text = call_text([("l", json.dumps(value, separators=(",", ":"), ensure_ascii=False), False)])
    assert grammar_accepts(schema, text)
    assert [json.loads(c.arguments) for c in parse_tool_calls(text).tool_calls] == [{"l": value}]


def test_the_marker_is_refused_in_values_also_where_json_would_carry_it() -> None:
    """Inside a JSON value the parser would read the close tag back (above); the rule is
    kept one and simple all the same: the marker is a special token no value needs."""
    nested = obj({"o": {"const": {"k": CLOSE}}})
    assert refusal([nested]).param == "tools[0].function.parameters.properties.o.const.k"
    quoted = obj({"o": obj({'q"': {"type": "integer"}})})
    assert refusal([quoted]).param == 'tools[0].function.parameters.properties.o.properties.q"'
