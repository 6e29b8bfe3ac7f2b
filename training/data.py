"""Training sequences (play text and chat-format dialogue) and fixed held-out windows."""

from __future__ import annotations

import random

import torch
from tokenizers import Tokenizer

from training.bpe import BOS_ID
from training.chat_data import render_conversation, speeches
from training.corpus import Play
from training.tool_data import tool_conversation


def encode_play(tokenizer: Tokenizer, play: Play) -> torch.Tensor:
    """BOS then the play's text, as a completion request would send it."""
    ids = tokenizer.encode(play.text, add_special_tokens=False).ids
    return torch.tensor([BOS_ID, *ids], dtype=torch.long)


class SequenceSampler:
    """Random training sequences of ``seq_len + 1`` tokens (inputs and shifted targets).

    With probability ``chat_fraction`` a sequence packs conversations of
    consecutive speeches (1-3 exchanges; thinking on for half, the play's
    title as system prompt for 30%, as a served chat request would render
    them); with probability ``tool_fraction`` it is tool-call conversations
    (tool_data.py) packed and cut so that the sequence ends at the end of one,
    so the call after a long tool block is always seen; otherwise it is a
    window of one play's text, plays weighted by length. Deterministic for a seed.

    ``served_ends`` makes the sequences look like what the server sends and
    expects back: a play window starts with BOS (as every completion prompt
    does), and chat is cut so that the sequence ends with a reply's EOS, so the
    end of a reply is always seen (the default, a cut anywhere, is what the
    committed demo was trained on).

    ``short_replies`` is the chance that an assistant turn keeps only its first
    one or two sentences (cut after a line ending in ``.``, ``!`` or ``?``,
    ``first_sentences``): a served reply is a few lines long, and in a play a
    line's full stop is followed by more verse far more often than a speech
    ends, so without short replies the model continues where it should stop.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        plays: list[Play],
        seq_len: int,
        chat_fraction: float,
        seed: int,
        tool_fraction: float = 0.0,
        served_ends: bool = False,
        short_replies: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.chat_fraction = chat_fraction
        self.tool_fraction = tool_fraction
        self.served_ends = served_ends
        self.short_replies = short_replies
        self.rng = random.Random(seed)
        self.texts = [encode_play(tokenizer, p) for p in plays]
        self.speeches = [speeches(p.text) for p in plays]
        self.titles = [p.title for p in plays]
        self.weights = [len(t) for t in self.texts]
        self.replies = [s for lines in self.speeches for s in lines]

    def sample(self) -> torch.Tensor:
        draw = self.rng.random()
        if draw < self.chat_fraction:
            return self._chat()
        if draw < self.chat_fraction + self.tool_fraction:
            return self._tool_calls()
        (ids,) = self.rng.choices(self.texts, weights=self.weights)
        if self.served_ends:
            start = self.rng.randrange(1, len(ids) - self.seq_len + 1)
            return torch.cat([ids[:1], ids[start : start + self.seq_len]])  # ids[0] is BOS
        start = self.rng.randrange(len(ids) - self.seq_len)
        return ids[start : start + self.seq_len + 1]

    def _chat(self) -> torch.Tensor:
        ids: list[int] = []
        while len(ids) <= self.seq_len:
            ids += self.tokenizer.encode(self.conversation(), add_special_tokens=False).ids
        cut = ids[-(self.seq_len + 1) :] if self.served_ends else ids[: self.seq_len + 1]
        return torch.tensor(cut, dtype=torch.long)

    def _tool_calls(self) -> torch.Tensor:
        ids: list[int] = []
        while len(ids) <= self.seq_len:
            text = tool_conversation(self.rng, self.replies).text
            ids += self.tokenizer.encode(text, add_special_tokens=False).ids
        return torch.tensor(ids[-(self.seq_len + 1) :], dtype=torch.long)

    def conversation(self) -> str:
        play = self.rng.randrange(len(self.speeches))
        lines = self.speeches[play]
        turns = 2 * self.rng.randint(1, 3)
        start = self.rng.randrange(len(lines) - turns)
        thinking = self.rng.random() < 0.5
        system = self.titles[play] if self.rng.random() < 0.3 else None
        effort = 75 if self.rng.random() < 0.7 else self.rng.randint(1, 100)
        spoken = lines[start : start + turns]
        if self.short_replies:
            spoken = [
                first_sentences(line, self.rng.randint(1, 2))
                if i % 2 and self.rng.random() < self.short_replies
                else line
                for i, line in enumerate(spoken)
            ]
        return render_conversation(spoken, thinking=thinking, system=system, effort=effort)


def first_sentences(speech: str, count: int) -> str:
    """The speech's lines up to its ``count``-th line that ends a sentence (the whole
    speech when it has fewer)."""
    lines = speech.split("\n")
    ends = [i for i, line in enumerate(lines) if line.rstrip().endswith((".", "!", "?"))]
    if len(ends) < count:
        return speech
    return "\n".join(lines[: ends[count - 1] + 1])


def heldout_windows(
    tokenizer: Tokenizer, plays: list[Play], length: int, count: int
) -> list[torch.Tensor]:
    """``count`` windows of ``length`` tokens, evenly spaced over the held-out plays."""
    stream = torch.cat([encode_play(tokenizer, p) for p in plays])
    last = len(stream) - length
    if last < 0 or count < 1:
        raise ValueError(f"{len(stream)} held-out tokens cannot give {count} x {length}")
    starts = [round(i * last / max(1, count - 1)) for i in range(count)]
    return [stream[s : s + length] for s in starts]
