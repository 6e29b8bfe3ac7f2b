"""One chat choice's engine deltas -> reasoning, content, tool calls, counts and logprobs.

Engine outputs are written by hand (text, token ids, finish reason); the
expected split is written out by hand too.
"""

from __future__ import annotations

import json

import pytest

from engine.api.request import CompletionOutput
from engine.api.request import TokenLogprob as EngineLogprob
from engine.loader.tokenizer import load_tokenizer
from server.chat.chat_output import ChatOutputParser
from server.openai.logprobs import TokenTexts

THINK_END = 128822
CALL = (
    '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
)


def _out(text: str, ids: list[int], finish: str | None = None, lps=None) -> CompletionOutput:
    return CompletionOutput(0, text, ids, logprobs=lps, finish_reason=finish)


def _parser(**kw) -> ChatOutputParser:
    args = {"starts_in_reasoning": True, "parse_tools": False, "think_end_id": THINK_END} | kw
    return ChatOutputParser(**args)


def test_reasoning_then_content_across_a_split_tag() -> None:
    p = _parser()
    first = p.feed(_out("I think</th", [10, 11, 12]))
    assert (first.reasoning, first.content) == ("I think", "")
    second = p.feed(_out("ink>Answer", [THINK_END, 13]))
    assert (second.reasoning, second.content) == ("", "Answer")
    last = p.feed(_out(".", [14], "stop"))
    assert last.content == "."
    assert p.reasoning_tokens == 4  # 10, 11, 12 and </think> itself
    message = p.message(thinking=True)
    assert (message.reasoning_content, message.content) == ("I think", "Answer.")
    assert message.tool_calls is None and p.finish_reason == "stop"


def test_unclosed_reasoning_is_flushed_at_the_end() -> None:
    p = _parser()
    p.feed(_out("still </thi", [1, 2]))
    piece = p.feed(_out("", [3], "length"))
    assert piece.reasoning == "</thi"  # the held-back partial tag was reasoning after all
    assert p.message(thinking=True).reasoning_content == "still </thi"
    assert p.message(thinking=True).content == ""
    assert p.reasoning_tokens == 3 and p.finish_reason == "length"


def test_thinking_off_has_no_reasoning() -> None:
    p = _parser(starts_in_reasoning=False)
    p.feed(_out("plain </think> text", [1, THINK_END, 2], "stop"))
    assert p.reasoning_tokens == 0
    message = p.message(thinking=False)
    assert message.content == "plain </think> text" and message.reasoning_content is None


def test_tool_call_streamed_by_character() -> None:
    p = _parser(starts_in_reasoning=False, parse_tools=True)
    text = "Let me check." + CALL
    pieces = [p.feed(_out(ch, [i])) for i, ch in enumerate(text)]
    pieces.append(p.feed(_out("", [999], "stop")))
    content = "".join(x.content for x in pieces)
    deltas = [d for x in pieces for d in x.tool_calls]
    assert content == "Let me check."
    header, *fragments = deltas
    assert (header.index, header.name, header.arguments) == (0, "get_weather", "")
    assert header.id is not None and header.id.startswith("call_")
    assert all(d.id is None and d.index == 0 for d in fragments)
    arguments = "".join(d.arguments for d in fragments)
    assert json.loads(arguments) == {"city": "Paris", "days": 3}
    assert p.finish_reason == "tool_calls"
    message = p.message(thinking=False)
    assert message.content == "Let me check."
    (call,) = message.tool_calls
    assert call.id == header.id and call.function.arguments == arguments


def test_header_and_fragments_in_one_feed_stay_apart() -> None:
    """One engine delta holding a whole call still gives a header with ``arguments: ""``."""
    p = _parser(starts_in_reasoning=False, parse_tools=True)
    piece = p.feed(_out(CALL, [1], "stop"))
    header, fragment = piece.tool_calls
    assert header.arguments == "" and header.name == "get_weather"
    assert fragment.id is None and json.loads(fragment.arguments)["days"] == 3
    delta = piece.delta(thinking=False).model_dump()
    assert delta["tool_calls"][0] == {
        "index": 0,
        "id": header.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert delta["tool_calls"][1] == {"index": 0, "function": {"arguments": fragment.arguments}}


def test_length_cut_call_reports_length_and_only_call_is_null_content() -> None:
    p = _parser(starts_in_reasoning=False, parse_tools=True)
    cut = CALL[: CALL.index("Paris") + 3]
    p.feed(_out(cut, [1], "length"))
    assert p.finish_reason == "length"
    message = p.message(thinking=False)
    assert message.content is None  # only a (cut) call
    # The arguments generated so far, not closed into JSON.
    assert message.tool_calls[0].function.arguments == '{"city": "Par'


def test_a_closed_block_is_tool_calls_even_when_the_budget_ends_there() -> None:
    p = _parser(starts_in_reasoning=False, parse_tools=True)
    p.feed(_out(CALL, [1], "length"))
    assert p.finish_reason == "tool_calls"


@pytest.fixture(scope="module")
def texts() -> TokenTexts:
    return TokenTexts(load_tokenizer())


def test_logprobs_split_at_the_think_end_token(texts: TokenTexts) -> None:
    p = _parser(token_texts=texts)
    ids = [100, THINK_END, 200, 300]
    lps = [EngineLogprob(i, -float(k + 1)) for k, i in enumerate(ids)]
    p.feed(_out("ab</think>cd", ids, "stop", lps))
    logprobs = p.logprobs()
    assert [e.logprob for e in logprobs.reasoning_content] == [-1.0, -2.0]
    assert [e.logprob for e in logprobs.content] == [-3.0, -4.0]
    assert logprobs.reasoning_content[1].token == "</think>"
    assert _parser().logprobs() is None  # not asked for
