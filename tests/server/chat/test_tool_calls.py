"""DSML tool calls: rendering, whole-text parsing and streaming deltas on hand-written outputs."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from chat_helpers import parse_tool_calls

from engine.loader.tokenizer import load_tokenizer
from server.chat.tool_calls import (
    ParseDelta,
    ToolCallDelta,
    ToolCallParser,
    arguments_dict,
    new_call_id,
    render_tool_calls,
)

# A model output as V4.1 writes it: answer text, a blank line, one calls block.
OUTPUT = (
    "I'll check both.\n\n"
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">São "Paulo"\n</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="get_time">\n'
    '<｜DSML｜ parameter name="opts" string="false">{"h24": true, "zones": ["CET"]}'
    "</｜DSML｜ parameter>\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
)
EXPECTED_CONTENT = "I'll check both."
EXPECTED_ARGS = [
    '{"city": "São \\"Paulo\\"\\n", "days": 3}',
    '{"opts": {"h24": true, "zones": ["CET"]}}',
]


def counter_ids():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def oracle(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """An independent regex reading of a well-formed output."""
    head, _, block = text.partition("<｜DSML｜ calls>")
    calls = []
    for name, body in re.findall(
        r'<｜DSML｜ invoke name="([^"]*)">(.*?)</｜DSML｜ invoke>', block, re.S
    ):
        args = {}
        for key, is_str, value in re.findall(
            r'<｜DSML｜ parameter name="([^"]*)" string="(true|false)">(.*?)</｜DSML｜ parameter>',
            body,
            re.S,
        ):
            args[key] = value if is_str == "true" else json.loads(value)
        calls.append((name, args))
    return head.rstrip(), calls


def run_stream(pieces: list[str]) -> tuple[list[ParseDelta], ToolCallParser]:
    parser = ToolCallParser(counter_ids())
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    return deltas, parser


def collect(deltas: list[ParseDelta]) -> tuple[str, dict[int, dict]]:
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for t in d.tool_calls:
            call = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            if t.id is not None:
                assert call["id"] is None, "one header per call"
                call.update(id=t.id, name=t.name)
            else:
                assert call["id"] is not None, "fragments follow the header"
            call["arguments"] += t.arguments
    return content, calls


def test_whole_text_against_hand_written_values() -> None:
    parsed = parse_tool_calls(OUTPUT, counter_ids())
    assert parsed.content == EXPECTED_CONTENT
    assert [(c.id, c.name, c.arguments) for c in parsed.tool_calls] == [
        ("call_0", "get_weather", EXPECTED_ARGS[0]),
        ("call_1", "get_time", EXPECTED_ARGS[1]),
    ]
    head, calls = oracle(OUTPUT)
    assert parsed.content == head
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


def test_first_delta_carries_the_header_then_fragments() -> None:
    deltas, _ = run_stream([OUTPUT])
    # Their OpenAI JSON: tests/server/chat/test_chat_output.py.
    first = deltas[0].tool_calls[0]
    assert first == ToolCallDelta(0, "call_0", "get_weather", "")
    second = deltas[0].tool_calls[1]
    assert second == ToolCallDelta(0, arguments=EXPECTED_ARGS[0])


@pytest.mark.parametrize("mode", ["chars", "random", "tokens"])
def test_streamed_pieces_match_the_whole_text(mode: str) -> None:
    if mode == "chars":
        pieces = list(OUTPUT)
    elif mode == "random":
        rng = random.Random(7)
        cuts = sorted(rng.sample(range(1, len(OUTPUT)), 40))
        pieces = [OUTPUT[a:b] for a, b in zip([0, *cuts], [*cuts, len(OUTPUT)], strict=True)]
    else:
        tokenizer = load_tokenizer()
        ids = tokenizer.encode(OUTPUT, add_special_tokens=False).ids
        assert 128825 in ids  # ｜DSML｜ is one token
        pieces = [tokenizer.decode([i]) for i in ids]
        assert "".join(pieces) == OUTPUT
    deltas, parser = run_stream(pieces)
    content, calls = collect(deltas)
    assert content == EXPECTED_CONTENT
    assert [(c["id"], c["name"], c["arguments"]) for c in calls.values()] == [
        ("call_0", "get_weather", EXPECTED_ARGS[0]),
        ("call_1", "get_time", EXPECTED_ARGS[1]),
    ]
    assert parser.has_calls
    assert all("<｜DSML｜" not in d.content and not d.content.endswith("<") for d in deltas)


def test_string_arguments_stream_before_their_close_tag() -> None:
    parser = ToolCallParser(counter_ids())
    parser.feed('<｜DSML｜ calls>\n<｜DSML｜ invoke name="echo">\n')
    parser.feed('<｜DSML｜ parameter name="text" string="true">Hel')
    delta = parser.feed("lo wor")
    assert [t.arguments for t in delta.tool_calls] == ["lo wor"]
    delta = parser.feed("ld</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>")
    assert "".join(t.arguments for t in delta.tool_calls) == 'ld"}'
    assert parser.tool_calls[0].arguments == '{"text": "Hello world"}'


def test_plain_answers_pass_through_unchanged() -> None:
    text = "Use a < b and <｜DSML｜ not a call>.\n\n"
    assert parse_tool_calls(text).content == text
    assert parse_tool_calls(text).tool_calls == []
    deltas, parser = run_stream(list(text))
    assert collect(deltas) == (text, {})
    assert not parser.has_calls


def test_whitespace_around_a_block_is_not_content_but_later_text_is() -> None:
    text = (
        "\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="ping">\n\n</｜DSML｜ invoke>\n'
        "</｜DSML｜ calls>\n\nAfter."
    )
    parsed = parse_tool_calls(text, counter_ids())
    assert parsed.content == "After."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("ping", "{}")]


def test_non_string_value_that_is_not_json_stays_a_string() -> None:
    text = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        '<｜DSML｜ parameter name="when" string="false">tomorrow</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
    assert parse_tool_calls(text).tool_calls[0].arguments == '{"when": "tomorrow"}'


def test_a_cut_call_keeps_the_arguments_generated_so_far() -> None:
    """Nothing is invented to close a cut call: no quote, brace or ``{}``."""
    head = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
    cut = head + '<｜DSML｜ parameter name="q" string="true">par'
    parser = ToolCallParser()
    parser.feed(cut)
    parser.finish()
    assert [c.arguments for c in parser.tool_calls] == ['{"q": "par']
    assert parser.has_calls and not parser.complete
    # A possible start of the close tag, held back while streaming, is not argument text.
    assert parse_tool_calls(cut + "</｜DSML｜ par").tool_calls[0].arguments == '{"q": "par'
    cut_header = '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f'
    assert parse_tool_calls(cut_header).tool_calls == []
    cut_number = head + '<｜DSML｜ parameter name="q" string="false">\n12 </｜DSML｜ para'
    assert parse_tool_calls(cut_number).tool_calls[0].arguments == '{"q": 12'
    no_params = parse_tool_calls(head)
    assert [c.arguments for c in no_params.tool_calls] == [""]
    after_one = head + '<｜DSML｜ parameter name="q" string="false">1</｜DSML｜ parameter>\n'
    assert parse_tool_calls(after_one).tool_calls[0].arguments == '{"q": 1'


def test_complete_only_once_the_block_closes() -> None:
    parser = ToolCallParser()
    parser.feed(OUTPUT[: OUTPUT.index("</｜DSML｜ calls>")])
    assert parser.has_calls and not parser.complete
    parser.feed("</｜DSML｜ calls>")
    assert parser.complete
    parser.finish()
    assert parser.complete


@pytest.mark.parametrize("cut", [40, 120, 171, 230, 300])
def test_streamed_cut_deltas_join_to_the_whole_cut_arguments(cut: int) -> None:
    text = OUTPUT[:cut]
    deltas, parser = run_stream([text[i : i + 3] for i in range(0, len(text), 3)])
    _, calls = collect(deltas)
    assert [c["arguments"] for c in calls.values()] == [
        c.arguments for c in parse_tool_calls(text).tool_calls
    ]
    assert [c["arguments"] for c in calls.values()] == [c.arguments for c in parser.tool_calls]


def test_render_then_parse_round_trips() -> None:
    calls = [
        ("search", '{"query": "a\\tb", "limit": 5, "filters": {"lang": ["en"]}, "exact": false}'),
        ("noop", "{}"),
    ]
    block = render_tool_calls(calls)
    assert block == (
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="search">\n'
        '<｜DSML｜ parameter name="query" string="true">a\tb</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="limit" string="false">5</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="filters" string="false">{"lang": ["en"]}</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="exact" string="false">false</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="noop">\n\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>"
    )
    parsed = parse_tool_calls("\n\n" + block)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (name, json.loads(args)) for name, args in calls
    ]


def test_arguments_dict_is_lenient_like_the_reference_encoder() -> None:
    assert arguments_dict('{"a": 1}') == {"a": 1}
    assert arguments_dict(json.dumps('{"a": 1}')) == {"a": 1}  # double-encoded
    assert arguments_dict({"a": 1}) == {"a": 1}
    assert arguments_dict("not json") == {"arguments": "not json"}
    assert arguments_dict("[1, 2]") == {"arguments": "[1, 2]"}


def test_call_ids() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


@pytest.mark.parametrize("name", ["c>d", "x>", "<b>", "c<d"])
def test_angle_brackets_in_a_parameter_name_stream_like_the_whole_text(name: str) -> None:
    """A header ends at '">' (a quote in a name is refused: server/chat/tool_schemas.py); a
    '>' inside the name is name text, also while the header is still arriving."""
    text = (
        '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        f'<｜DSML｜ parameter name="{name}" string="true">v</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
    _, expected = oracle(text)
    assert expected == [("f", {name: "v"})]
    deltas, parser = run_stream(list(text))
    content, calls = collect(deltas)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected
    assert parser.complete


# Cuts of a forced call's first tokens: the grammar writes "\n\n<｜DSML｜ calls>\n" first.
FORCED_CUTS = ["\n", "\n\n", "\n\n<", "\n\n<｜DSML｜", "\n\n<｜DSML｜ ca", "\n\n<｜DSML｜ calls"]


@pytest.mark.parametrize("cut", FORCED_CUTS)
def test_a_cut_forced_call_puts_no_markup_into_content(cut: str) -> None:
    for pieces in ([cut], list(cut)):  # whole, and one character a delta
        parser = ToolCallParser(counter_ids(), forced=True)
        deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert collect(deltas) == ("", {}), pieces
        assert not parser.has_calls and not parser.complete


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("Sure.\n\n<｜DSML｜ cal", "Sure."),  # a calls block begun: markup, dropped
        ("Sure.\n\n<｜DSML｜", "Sure."),
        ("a <", "a <"),  # a bare '<' may be the answer's own text
        ("a\n\n", "a\n\n"),
    ],
)
def test_a_block_cut_before_it_opened_is_not_content_in_auto_mode_either(
    text: str, content: str
) -> None:
    for pieces in ([text], list(text)):
        deltas, _ = run_stream(pieces)
        assert collect(deltas) == (content, {}), pieces


def test_the_close_tag_inside_a_json_string_of_a_non_string_value_is_text() -> None:
    """The grammar lets a string inside a JSON value hold any text (the check in
    tests/server/chat/test_tool_schemas.py); only a close tag outside JSON strings ends
    the value."""
    value = ["a</｜DSML｜ parameter>b", 'q"</｜DSML｜ parameter>', "\\"]
    text = (
        '<｜DSML｜ calls>\n<｜DSML｜ invoke name="f">\n'
        f'<｜DSML｜ parameter name="l" string="false">{json.dumps(value, ensure_ascii=False)}'
        "</｜DSML｜ parameter>\n"
        '<｜DSML｜ parameter name="n" string="false">2</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    )
    expected = [("f", {"l": value, "n": 2})]
    for pieces in ([text], list(text)):
        deltas, parser = run_stream(pieces)
        content, calls = collect(deltas)
        assert content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == expected
        assert parser.complete
