"""The drafter's prompts are what the server renders: a chat of one user turn as
``encode_chat`` writes it (thinking on and off), a completion as ``encode_completion``,
a tool call's prompt as ``encode_chat`` writes the request up to the call;
training prompts from the training plays, evaluation prompts from the held-out ones."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from server.chat.chat_encoding import encode_chat, encode_completion
from server.openai.protocol import ChatCompletionRequest, ChatMessage
from training.corpus import Play
from training.demo_config import demo_checkpoint_dir
from training.dspark_prompts import (
    PromptMix,
    chat_prompt,
    completion_text,
    draw_prompts,
    tool_prompt,
)
from training.tool_data import tool_conversation

TRAIN = Play("a", "A", "Ham.\nTo be, or not to be, that is the question:\nWhether 'tis nobler\n")
HELD = Play("b", "B", "Hor.\nMy lord, I came to see your father's funeral.\nI pray thee\n")


@pytest.mark.parametrize("thinking", [False, True])
def test_a_chat_prompt_is_the_servers(thinking: bool) -> None:
    served = encode_chat(
        [ChatMessage(role="user", content="Who's there?")], thinking=thinking, reasoning_effort=75
    )
    assert chat_prompt("Who's there?", thinking=thinking) == served


def test_prompts_come_from_their_plays_and_are_seeded() -> None:
    tokenizer = Tokenizer.from_file(str(demo_checkpoint_dir() / "tokenizer.json"))
    mix = PromptMix(count=12, chat_fraction=0.5, lines=2)
    held = [
        tokenizer.decode(p, skip_special_tokens=False)
        for p in draw_prompts(tokenizer, [HELD], mix, 3)
    ]
    assert all("funeral" in t or "pray" in t or "lord" in t for t in held)
    assert not any("question" in t for t in held)
    assert draw_prompts(tokenizer, [TRAIN], mix, 3) == draw_prompts(tokenizer, [TRAIN], mix, 3)
    kinds = {t.startswith(encode_completion("")) and "<｜User｜>" in t for t in held}
    assert kinds == {True, False}  # chats and completions both drawn
    line = completion_text(TRAIN, random.Random(0), 2)
    assert line.endswith("\n") and line.count("\n") == 2


@pytest.mark.parametrize("seed", range(6))
def test_a_tool_prompt_is_the_servers_prompt_for_the_request_before_the_call(seed: int) -> None:
    replies = ["Now is the winter of our discontent."]
    sample = tool_conversation(random.Random(seed), replies)
    asked = sample.messages[: [m["role"] for m in sample.messages].index("assistant")]
    tools = [{"type": "function", "function": f} for f in sample.functions]
    request = ChatCompletionRequest.model_validate(
        {"model": "demo", "messages": asked, "tools": tools}
    )
    served = encode_chat(
        request.messages, tools=request.tools, thinking=sample.thinking, reasoning_effort=75
    )
    assert tool_prompt(random.Random(seed), replies) == served


def test_a_tool_fraction_draws_tool_prompts_and_leaves_the_others_as_they_were() -> None:
    tokenizer = Tokenizer.from_file(str(demo_checkpoint_dir() / "tokenizer.json"))
    plain = draw_prompts(tokenizer, [TRAIN], PromptMix(count=20, chat_fraction=0.3), 4)
    mixed = draw_prompts(tokenizer, [TRAIN], PromptMix(20, 0.3, tool_fraction=0.4), 4)
    texts = [tokenizer.decode(p, skip_special_tokens=False) for p in mixed]
    tools = [i for i, t in enumerate(texts) if "tool name and parameter schemas" in t]
    assert 0 < len(tools) < 20
    # The same draws pick the kind, so every other prompt is the tool-free mix's.
    assert all(mixed[i] == plain[i] for i in range(20) if i not in tools)
