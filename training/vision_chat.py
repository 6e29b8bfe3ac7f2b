"""A chat about one picture as token ids, laid out as the server will lay out an image.

The rule (the same the server follows for an ``image_url`` part): a user
message's content parts are joined by a blank line, as its text parts are
(server/openai/protocol.py ``content_text``), and an image part stands at its place as
its span: ``plan.tokens`` copies of the image placeholder id. So a message
``[image, "What colour is the circle?"]`` becomes ``<｜User｜>`` + span + ``"\\n\\n"``
+ question. The rest is training/chat_data.py's rendering (reasoning always
empty, each reply ending in EOS, a thinking request's system turn holding the
Reasoning Effort line).

Text is tokenised piece by piece, each piece bounded by special tokens (which the
tokenizer never merges across), so the ids are those of the whole prompt; the
pieces also say which ids are the replies the loss is taken on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from training.bpe import ASSISTANT, BOS, EOS, SYSTEM, THINK_END, THINK_START, USER
from training.chat_data import EFFORT_LINE

PART_SEPARATOR = "\n\n"


@dataclass(frozen=True, slots=True)
class ImageChat:
    ids: torch.Tensor  # [T] int64, the span as ``image_tokens`` placeholder ids
    targets: torch.Tensor  # [T] bool: the id is part of a reply (the loss's rows predict it)


def image_chat(
    tokenizer: Tokenizer,
    image_token_id: int,
    image_tokens: int,
    turns: list[tuple[str, str]],
    *,
    thinking: bool = False,
    image_last: bool = False,
    effort: int = 75,
) -> ImageChat:
    """Ids of a conversation whose first user message is the picture and its first
    question (the picture after the question when ``image_last``), then more turns.

    The last reply ends with EOS and no generation prompt follows (a training example);
    ``prompt_ids`` is the form the evaluation decodes from. With ``image_tokens`` 0
    there is no picture: the first question is a text-only message, as the server
    renders one.
    """
    pieces: list[tuple[str | None, bool]] = [(BOS, False)]
    if thinking:
        pieces.append((SYSTEM + EFFORT_LINE.format(budget=effort), False))
    for i, (question, answer) in enumerate(turns):
        last = i == len(turns) - 1
        opening = THINK_START + THINK_END if thinking and last else THINK_END
        pieces.append((USER, False))
        if i == 0 and image_tokens:
            first = [(None, False), (PART_SEPARATOR + question, False)]
            if image_last:
                first = [(question + PART_SEPARATOR, False), (None, False)]
            pieces += first
        else:
            pieces.append((question, False))
        pieces += [(ASSISTANT + opening, False), (answer + EOS, True)]
    ids: list[int] = []
    targets: list[bool] = []
    for text, is_target in pieces:
        piece = (
            [image_token_id] * image_tokens
            if text is None
            else tokenizer.encode(text, add_special_tokens=False).ids
        )
        ids += piece
        targets += [is_target] * len(piece)
    return ImageChat(torch.tensor(ids, dtype=torch.long), torch.tensor(targets))


def prompt_ids(
    tokenizer: Tokenizer,
    image_token_id: int,
    image_tokens: int,
    question: str,
    *,
    thinking: bool = False,
) -> torch.Tensor:
    """The generation prompt of a one-turn chat ``[image, question]``: up to and
    including the assistant's opening, as the server renders it."""
    chat = image_chat(tokenizer, image_token_id, image_tokens, [(question, "")], thinking=thinking)
    tail = tokenizer.encode(EOS, add_special_tokens=False).ids
    return chat.ids[: len(chat.ids) - len(tail)]
