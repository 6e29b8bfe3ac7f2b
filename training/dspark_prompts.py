"""Prompts for distilling the demo's drafter: what the demo is served on.

Three kinds, each rendered as the server renders them (server/chat/chat_encoding.py,
which a test holds these to; training does not import the server): completions
(BOS, then a stretch of a play starting at a line), chats (one user turn of a
speech, thinking on or off; the demo is served as a chat model) and tool calls
(training/tool_data.py's conversations up to the assistant turn that calls a
tool: the agents' case, whose replies are DSML blocks of JSON values that verse
alone never teaches a drafter). Training prompts come from the
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
from training.tool_data import tool_conversation

TOOL_SEED = 0x7001


@dataclass(frozen=True, slots=True)
class PromptMix:
    """``count`` prompts, ``chat_fraction`` of them chats and ``tool_fraction`` tool
    calls; a completion prompt is ``lines`` consecutive lines of a play, a chat's
    user turn one speech (at most ``max_chars`` characters of it)."""

    count: int
    chat_fraction: float = 0.3
    tool_fraction: float = 0.0
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


def tool_prompt(rng: random.Random, replies: list[str]) -> str:
    """A tool conversation's prompt up to where the assistant writes its call."""
    text = tool_conversation(rng, replies).text
    # The system prompt names the think tags too, never right after the Assistant tag.
    openings = [ASSISTANT + tag for tag in (THINK_START, THINK_END)]
    at, opening = min((text.find(o), o) for o in openings if o in text)
    return text[: at + len(opening)]


def draw_prompts(
    tokenizer: Tokenizer, plays: list[Play], mix: PromptMix, seed: int
) -> list[list[int]]:
    """``mix.count`` token prompts drawn from ``plays`` (seeded)."""
    rng = random.Random(seed)
    spoken = [speeches(p.text) for p in plays]
    replies = [s for lines in spoken for s in lines]
    # Tool conversations draw from their own stream, so the mix's other prompts are
    # those of the same seed without tools.
    tool_rng = random.Random(seed ^ TOOL_SEED)
    out = []
    for _ in range(mix.count):
        i = rng.randrange(len(plays))
        draw = rng.random()
        if draw < mix.chat_fraction and spoken[i]:
            speech = spoken[i][rng.randrange(len(spoken[i]))][: mix.max_chars]
            text = chat_text(speech, rng)
        else:
            text = BOS + completion_text(plays[i], rng, mix.lines)  # a completion prompt
        if draw >= 1 - mix.tool_fraction:  # drawn above all the same, to keep the stream
            text = tool_prompt(tool_rng, replies)
        # The texts carry BOS themselves (the tokenizer adds none).
        out.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return out
