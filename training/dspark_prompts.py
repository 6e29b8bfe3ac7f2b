"""Prompts for distilling the demo's drafter: what the demo is served on.

Two kinds, both rendered as the server renders them (server/chat/chat_encoding.py,
which a test holds these to; training does not import the server): completions
(BOS, then a stretch of a play starting at a line) and chats (one user turn of a
speech, thinking on or off; the demo is served as a chat model). Training prompts come from the
training plays, evaluation prompts from the held-out plays (training/corpus.py),
so acceptance is measured on text the target never saw either.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenizers import Tokenizer

from training.bpe import ASSISTANT, BOS, SYSTEM, THINK_END, THINK_START, USER
from training.chat_data import EFFORT_LINE, speeches
from training.corpus import Play


@dataclass(frozen=True, slots=True)
class PromptMix:
    """``count`` prompts, ``chat_fraction`` of them chats; a completion prompt is
    ``lines`` consecutive lines of a play, a chat's user turn one speech (at most
    ``max_chars`` characters of it)."""

    count: int
    chat_fraction: float = 0.3
    lines: int = 3
    max_chars: int = 240


def completion_text(play: Play, rng: random.Random, lines: int) -> str:
    """``lines`` consecutive non-empty lines of ``play`` from a random line."""
    rows = [r for r in play.text.split("\n") if r.strip()]
    start = rng.randrange(max(1, len(rows) - lines))
    return "\n".join(rows[start : start + lines]) + "\n"


def chat_prompt(user: str, *, thinking: bool, effort: int = 75) -> str:
    """The server's prompt for a chat of one user turn, ending where the reply begins
    (inside ``<think>`` with thinking on, after ``</think>`` with it off)."""
    system = SYSTEM + EFFORT_LINE.format(budget=effort) if thinking else ""
    return BOS + system + USER + user + ASSISTANT + (THINK_START if thinking else THINK_END)


def chat_text(speech: str, rng: random.Random) -> str:
    """A chat prompt of one speech (thinking on for a quarter of them)."""
    return chat_prompt(speech, thinking=rng.random() < 0.25)


def draw_prompts(
    tokenizer: Tokenizer, plays: list[Play], mix: PromptMix, seed: int
) -> list[list[int]]:
    """``mix.count`` token prompts drawn from ``plays`` (seeded)."""
    rng = random.Random(seed)
    spoken = [speeches(p.text) for p in plays]
    out = []
    for _ in range(mix.count):
        i = rng.randrange(len(plays))
        if rng.random() < mix.chat_fraction and spoken[i]:
            speech = spoken[i][rng.randrange(len(spoken[i]))][: mix.max_chars]
            text = chat_text(speech, rng)
        else:
            text = BOS + completion_text(plays[i], rng, mix.lines)  # a completion prompt
        # The texts carry BOS themselves (the tokenizer adds none).
        out.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return out
