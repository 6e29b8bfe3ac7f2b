"""Speeches of a play, and conversations made of them in the V4.1 chat encoding.

A small share of the demo's training text is dialogue rendered exactly as the
server renders a chat request (server/chat/chat_encoding.py, which a test holds this
to): consecutive speeches alternate between the user and the assistant, so a
served chat request gets a reply in verse that ends with EOS. Reasoning is
always empty: with thinking on the model learns to close ``<think>`` at once.
"""

from __future__ import annotations

import re

from training.bpe import ASSISTANT, BOS, EOS, SYSTEM, THINK_END, THINK_START, USER

# The Reasoning Effort line of a thinking request's system turn (server/chat/chat_encoding.py).
EFFORT_LINE = (
    "Reasoning Effort: {budget} "
    "(range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)
# A speaker line: "Ham.", "First Clown." or (one play) "THESEUS".
_SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]{0,30}\.|[A-Z][A-Z' ]{0,30})$")
_STAGE = re.compile(r"^\[.*\]$")


def speeches(text: str) -> list[str]:
    """The spoken text of each speech, in order; stage directions dropped.

    In these texts a speech is a block (blank-line separated) whose first line
    names the speaker; the name is dropped, the verse kept line by line.
    """
    out = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        if len(lines) < 2 or not _SPEAKER.match(lines[0]):
            continue
        spoken = [line.strip() for line in lines[1:] if not _STAGE.match(line.strip())]
        if spoken:
            out.append("\n".join(spoken))
    return out


def render_conversation(
    turns: list[str], *, thinking: bool, system: str | None = None, effort: int = 75
) -> str:
    """BOS, an optional system turn, then user/assistant pairs, each reply ending in EOS.

    ``turns`` alternate user, assistant, ... and end with an assistant turn.
    Only the last reply follows the open ``<think>`` (history turns keep no
    reasoning), as the server encodes a conversation.
    """
    if len(turns) % 2:
        raise ValueError("a conversation ends with the assistant's turn")
    out = [BOS]
    if thinking or system is not None:
        out.append(
            SYSTEM + (EFFORT_LINE.format(budget=effort) if thinking else "") + (system or "")
        )
    for i in range(0, len(turns), 2):
        last = i == len(turns) - 2
        opening = THINK_START + THINK_END if thinking and last else THINK_END
        out.append(USER + turns[i] + ASSISTANT + opening + turns[i + 1] + EOS)
    return "".join(out)
