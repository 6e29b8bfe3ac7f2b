"""Whole-text oracles of the chat tests: the product parses generated text only as it
streams (server/chat/chat_output.py joins the deltas for a non-streamed answer); these
run the same parsers, or plain string and bit arithmetic, over a whole output.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.api.special_tokens import THINK_END
from server.chat.tool_calls import ParsedToolCall, ToolCallParser, new_call_id


def split_reasoning(text: str, *, starts_in_reasoning: bool = True) -> tuple[str, str]:
    """``(reasoning, content)`` of a whole generated text: the first ``</think>`` ends
    reasoning (string partition, not the streaming parser)."""
    if not starts_in_reasoning:
        return "", text
    reasoning, sep, content = text.partition(THINK_END)
    return reasoning, content if sep else ""


@dataclass(slots=True)
class ParsedOutput:
    content: str
    tool_calls: list[ParsedToolCall]


def parse_tool_calls(text: str, id_factory: Callable[[], str] = new_call_id) -> ParsedOutput:
    """Content and tool calls of a whole generated text, fed to the parser at once."""
    parser = ToolCallParser(id_factory)
    content = parser.feed(text).content + parser.finish().content
    return ParsedOutput(content, parser.tool_calls)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Expand an int32 token bitmask into bool ``[vocab_size]``: an expansion apart from
    the sampler's (``allowed_token_mask``), to check it by.

    Bytes are unpacked least significant bit first, so on a little-endian host
    bit ``j`` of word ``i`` lands at ``32 i + j`` (numpy: single-threaded and
    ~100x faster than torch's shift under CPU contention).
    """
    assert sys.byteorder == "little"
    words = bitmask.to(torch.int32).contiguous().numpy()
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.astype(bool))
