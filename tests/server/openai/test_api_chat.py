"""Chat completions against the live server with the official ``openai`` client.

The tiny model is random, so the checks are structure, counts and constraints.
Oracles: prompts written out by hand and tokenised here, a second request
that must agree (seeds, streams vs whole bodies), and logit biases that force
a known token.
"""

from __future__ import annotations

import openai
import pytest
from api_helpers import (
    API_KEY,
    DEFAULT_MAX_TOKENS,
    ENV_API_KEY,
    THINK_END_ID,
    LiveServer,
    stream_raw,
)

BOS = "<｜begin▁of▁sentence｜>"
EFFORT_75 = (
    "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
HELLO = [{"role": "user", "content": "Hello!"}]
ALIASES_THINKING = {
    "deepseek-flash": True,
    "deepseek-v4-flash": True,
    "deepseek-v4-pro": True,
    "deepseek-chat": False,
    "deepseek-reasoner": True,
}


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def _check_usage(usage, *, completion: int | None = None) -> None:
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    extra = usage.model_extra
    assert extra["prompt_cache_hit_tokens"] + extra["prompt_cache_miss_tokens"] == (
        usage.prompt_tokens
    )
    assert usage.prompt_tokens_details.cached_tokens == extra["prompt_cache_hit_tokens"]
    assert usage.completion_tokens_details.reasoning_tokens <= usage.completion_tokens
    if completion is not None:
        assert usage.completion_tokens == completion


def test_chat_completion_shape_and_hand_counted_prompt(
    client: openai.OpenAI, served_tokenizer
) -> None:
    r = client.chat.completions.create(model="deepseek-chat", messages=HELLO, max_tokens=4)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == "deepseek-chat" and r.system_fingerprint.startswith("fp_")
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls is None
    assert "reasoning_content" not in choice.message.model_extra  # thinking off
    prompt = BOS + "<｜User｜>Hello!<｜Assistant｜></think>"
    assert r.usage.prompt_tokens == _count(served_tokenizer, prompt)
    _check_usage(r.usage)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 4


@pytest.mark.parametrize("model", sorted(ALIASES_THINKING))
def test_model_aliases_route_with_their_thinking_default(
    client: openai.OpenAI, served_tokenizer, model: str
) -> None:
    r = client.chat.completions.create(model=model, messages=HELLO, max_tokens=1)
    assert r.model == model
    thinking = ALIASES_THINKING[model]
    assert ("reasoning_content" in r.choices[0].message.model_extra) == thinking
    if thinking:
        prompt = BOS + "<｜System｜>" + EFFORT_75 + "<｜User｜>Hello!<｜Assistant｜><think>"
    else:
        prompt = BOS + "<｜User｜>Hello!<｜Assistant｜></think>"
    assert r.usage.prompt_tokens == _count(served_tokenizer, prompt)


def test_alias_path_and_env_key(live_server: LiveServer) -> None:
    """``/chat/completions`` without ``/v1``, called with the key from FLASHSERVE_API_KEYS."""
    body = {"model": "deepseek-chat", "messages": HELLO, "max_tokens": 1}
    r = live_server.post("/chat/completions", body, api_key=ENV_API_KEY)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"


def test_thinking_splits_at_the_think_end_token(client: openai.OpenAI) -> None:
    """A +100 bias makes every token ``</think>``: the first ends reasoning, the rest is text."""
    r = client.chat.completions.create(
        model="deepseek-chat",
        messages=HELLO,
        max_tokens=5,
        logit_bias={str(THINK_END_ID): 100},
        extra_body={"thinking": {"type": "enabled"}},
    )
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == ""
    assert message.content == "</think>" * 4
    assert r.usage.completion_tokens_details.reasoning_tokens == 1
    assert r.choices[0].finish_reason == "length"


def test_reasoning_without_end_is_all_reasoning(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="deepseek-reasoner",
        messages=HELLO,
        max_tokens=6,
        logit_bias={str(THINK_END_ID): -100},
        reasoning_effort="high",
    )
    message = r.choices[0].message
    assert message.content == ""
    assert isinstance(message.model_extra["reasoning_content"], str)
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens == 6


def test_streamed_thinking_equals_whole_response(live_server: LiveServer) -> None:
    body = {
        "model": "deepseek-reasoner",
        "messages": HELLO,
        "max_tokens": 8,
        "seed": 11,
        # </think> likely but not first: both parts are non-empty most of the time.
        "logit_bias": {str(THINK_END_ID): 11},
    }
    whole = live_server.post("/v1/chat/completions", body).json()
    events, _ = stream_raw(live_server, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    message = whole["choices"][0]["message"]
    assert reasoning == message["reasoning_content"]
    assert content == message["content"]
    # Reasoning deltas come first: no reasoning after the first content text.
    kinds = [
        "r" if d.get("reasoning_content") else "c"
        for d in deltas
        if d.get("reasoning_content") or d.get("content")
    ]
    assert kinds == sorted(kinds, reverse=True)


def test_seed_reproducible_and_n_choices_follow_seed_plus_index(client: openai.OpenAI) -> None:
    kwargs = {"model": "deepseek-chat", "messages": HELLO, "max_tokens": 6, "temperature": 1.0}
    singles = [client.chat.completions.create(seed=1234 + k, **kwargs) for k in range(3)]
    again = client.chat.completions.create(seed=1234, **kwargs)
    assert again.choices[0].message.content == singles[0].choices[0].message.content
    n = client.chat.completions.create(seed=1234, n=3, **kwargs)
    assert [c.index for c in n.choices] == [0, 1, 2]
    # Choice k of an n-request samples like a single request seeded seed + k.
    for k in range(3):
        assert n.choices[k].message.content == singles[k].choices[0].message.content
    assert n.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert n.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counts once


def test_stop_string_ends_the_output_before_it(client: openai.OpenAI) -> None:
    kwargs = {"model": "deepseek-chat", "messages": HELLO, "temperature": 0, "logprobs": True}
    free = client.chat.completions.create(max_tokens=8, **kwargs)
    tokens = [t.token for t in free.choices[0].logprobs.content]
    text = free.choices[0].message.content
    stop = next(t for t in tokens[2:] if t.strip() and "\ufffd" not in t)
    cut = client.chat.completions.create(max_tokens=8, stop=[stop, "never-appears"], **kwargs)
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_logprobs_bytes_and_top_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="deepseek-chat",
        messages=HELLO,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    text = b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace")
    if choice.finish_reason == "length" and "\ufffd" not in text:
        assert text == choice.message.content
    for e in entries:
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        # Greedy: the sampled token is the best alternative.
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(values[0])
        assert bytes(e.top_logprobs[0].bytes) == bytes(e.bytes)


def test_stream_structure_and_usage_equal_to_whole(live_server: LiveServer) -> None:
    body = {
        "model": "deepseek-chat",
        "messages": HELLO,
        "max_tokens": 4,
        "n": 2,
        "seed": 5,
        "logprobs": True,
    }
    whole = live_server.post("/v1/chat/completions", body).json()
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events, raw = stream_raw(live_server, "/v1/chat/completions", stream_body)
    assert raw[-1] == "[DONE]" and raw.count("[DONE]") == 1
    assert len({(e["id"], e["created"], e["model"]) for e in events}) == 1
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert all("usage" in e and e["usage"] is None for e in chunks)
    for index in (0, 1):
        mine = [c for e in chunks for c in e["choices"] if c["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert all("role" not in c["delta"] for c in mine[1:])
        finishes = [c for c in mine if c["finish_reason"] is not None]
        assert len(finishes) == 1 and finishes[0] is mine[-1]
        whole_choice = whole["choices"][index]
        assert finishes[0]["finish_reason"] == whole_choice["finish_reason"]
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == whole_choice["message"]["content"]
        streamed_lp = [t for c in mine if c["logprobs"] for t in c["logprobs"]["content"]]
        assert streamed_lp == whole_choice["logprobs"]["content"]


def test_stream_without_include_usage_has_no_usage(live_server: LiveServer) -> None:
    body = {"model": "deepseek-chat", "messages": HELLO, "max_tokens": 2, "stream": True}
    events, _ = stream_raw(live_server, "/v1/chat/completions", body)
    assert events and all("usage" not in e for e in events)
    assert all(e["choices"] for e in events)


def test_openai_client_stream(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="deepseek-flash",
        messages=HELLO,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 3
    assert [c.choices[0].finish_reason for c in chunks[:-1]].count("length") == 1


def test_prefix_completion_at_beta(live_server: LiveServer, served_tokenizer) -> None:
    client = live_server.beta_client()
    messages = [
        {"role": "user", "content": "Write a word."},
        {"role": "assistant", "content": "The word:", "prefix": True},
    ]
    r = client.chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=3)
    prompt = BOS + "<｜User｜>Write a word.<｜Assistant｜></think>The word:"
    assert r.usage.prompt_tokens == _count(served_tokenizer, prompt)
    assert not r.choices[0].message.content.startswith("The word:")  # only the continuation
    assert r.usage.completion_tokens <= 3


def test_max_completion_tokens_wins_over_max_tokens(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="deepseek-chat",
        messages=HELLO,
        max_tokens=7,
        max_completion_tokens=2,
        logit_bias={"1": -100},  # no EOS: the budget is what ends it
    )
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"


def test_default_max_tokens_applies(live_server: LiveServer) -> None:
    body = {"model": "deepseek-chat", "messages": HELLO, "logit_bias": {"1": -100}}
    usage = live_server.post("/v1/chat/completions", body).json()["usage"]
    assert usage["completion_tokens"] == DEFAULT_MAX_TOKENS


def test_second_api_key_authenticates(live_server: LiveServer) -> None:
    for key in (API_KEY, ENV_API_KEY):
        models = live_server.client(api_key=key).models.list()
        ids = [m.id for m in models.data]
        assert ids == [
            "deepseek-flash",
            "deepseek-v4-flash",
            "deepseek-v4-pro",
            "deepseek-chat",
            "deepseek-reasoner",
        ]
