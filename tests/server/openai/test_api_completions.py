"""Text completions, echo, logprobs, several prompts, and FIM at ``/beta/completions``.

Oracles: prompts written out by hand and tokenised here; greedy runs repeated
through another path must agree.
"""

from __future__ import annotations

import openai
import pytest
from api_helpers import EOS_ID, LiveServer, stream_raw

BOS = "<｜begin▁of▁sentence｜>"
NO_EOS = {str(EOS_ID): -100}


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_completion_shape_and_prompt_count(client: openai.OpenAI, served_tokenizer) -> None:
    r = client.completions.create(
        model="deepseek-flash", prompt="def add(a, b):", max_tokens=4, logit_bias=NO_EOS
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.model == "deepseek-flash" and r.system_fingerprint.startswith("fp_")
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == _count(served_tokenizer, BOS + "def add(a, b):")
    assert r.usage.completion_tokens == 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4


def test_echo_and_logprobs(client: openai.OpenAI, served_tokenizer) -> None:
    kwargs = {"model": "deepseek-chat", "prompt": "Hello there", "max_tokens": 3}
    kwargs |= {"temperature": 0, "logit_bias": NO_EOS, "logprobs": 2}
    plain = client.completions.create(**kwargs)
    echoed = client.completions.create(echo=True, **kwargs)
    assert echoed.choices[0].text == "Hello there" + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    prompt_ids = served_tokenizer.encode("Hello there", add_special_tokens=False).ids
    # Prompt tokens come first, each scored (the prompt starts with BOS, so even the
    # first echoed token has context; tests/server/openai/test_api_prompt_logprobs.py checks
    # the values); then one row per generated token. A scored prompt runs at full
    # depth, so its continuation may differ from the CED one of ``plain``.
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[: len(prompt_ids)])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[: len(prompt_ids)])
    assert len(lp.tokens) == len(prompt_ids) + 3
    generated = plain.choices[0].logprobs
    assert len(generated.tokens) == 3
    for token, value, top in zip(
        generated.tokens, generated.token_logprobs, generated.top_logprobs, strict=True
    ):
        assert 1 <= len(top) <= 2  # alternatives decoding to one text share a key
        assert max(top.values()) == pytest.approx(value)  # greedy: the best
        assert top[token] == pytest.approx(value)
    # text_offset: where each token starts in the choice's text.
    text = echoed.choices[0].text
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        if "\ufffd" not in token:
            assert text[offset : offset + len(token)] == token


def test_several_prompts_and_n_order_choices(client: openai.OpenAI, served_tokenizer) -> None:
    prompts = ["One", "Two two"]
    r = client.completions.create(
        model="deepseek-chat", prompt=prompts, n=2, max_tokens=2, logit_bias=NO_EOS
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == sum(_count(served_tokenizer, BOS + p) for p in prompts)
    assert r.usage.completion_tokens == 8


def test_token_id_prompt_matches_text_prompt(client: openai.OpenAI, served_tokenizer) -> None:
    ids = served_tokenizer.encode(BOS + "Same prompt", add_special_tokens=False).ids
    kwargs = {"model": "deepseek-chat", "max_tokens": 3, "temperature": 0, "logit_bias": NO_EOS}
    by_text = client.completions.create(prompt="Same prompt", **kwargs)
    by_ids = client.completions.create(prompt=ids, **kwargs)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_fim_at_beta_and_suffix_at_v1_agree(live_server: LiveServer, served_tokenizer) -> None:
    body = {
        "model": "deepseek-chat",
        "prompt": "def f(x):\n    return ",
        "suffix": "\n\nprint(f(2))",
        "max_tokens": 3,
        "temperature": 0,
        "logit_bias": NO_EOS,
    }
    beta = live_server.beta_client().completions.create(**body)
    fim = BOS + "<｜fim▁begin｜>def f(x):\n    return <｜fim▁hole｜>\n\nprint(f(2))<｜fim▁end｜>"
    assert beta.usage.prompt_tokens == _count(served_tokenizer, fim)
    v1 = live_server.client().completions.create(**body)
    assert v1.choices[0].text == beta.choices[0].text
    # /beta is always FIM, even without a suffix.
    no_suffix = live_server.post("/beta/completions", {**body, "suffix": None}).json()
    plain = BOS + "<｜fim▁begin｜>def f(x):\n    return <｜fim▁hole｜><｜fim▁end｜>"
    assert no_suffix["usage"]["prompt_tokens"] == _count(served_tokenizer, plain)


def test_completion_stream(live_server: LiveServer) -> None:
    body = {
        "model": "deepseek-chat",
        "prompt": "Count:",
        "max_tokens": 3,
        "n": 2,
        "seed": 9,
        "echo": True,
        "logit_bias": NO_EOS,
    }
    whole = live_server.post("/v1/completions", body).json()
    events, raw = stream_raw(
        live_server,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert raw[-1] == "[DONE]"
    *chunks, last = events
    assert last["choices"] == [] and last["usage"] == whole["usage"]
    assert len({(e["id"], e["created"]) for e in events}) == 1
    for index in (0, 1):
        mine = [c for e in chunks for c in e["choices"] if c["index"] == index]
        assert "".join(c["text"] for c in mine) == whole["choices"][index]["text"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
        assert mine[0]["text"] == "Count:"  # the echo leads
