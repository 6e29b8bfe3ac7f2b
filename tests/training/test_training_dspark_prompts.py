"""The drafter's prompts are what the server renders: a chat of one user turn as
``encode_chat`` writes it (thinking on and off), a completion as ``encode_completion``;
training prompts from the training plays, evaluation prompts from the held-out ones."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from server.chat.chat_encoding import encode_chat, encode_completion
from server.openai.protocol import ChatMessage
from training.corpus import Play
from training.demo_config import demo_checkpoint_dir
from training.dspark_prompts import PromptMix, chat_prompt, completion_text, draw_prompts

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
