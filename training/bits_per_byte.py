"""Held-out bits per byte: a quality figure that compares models across tokenizers.

Perplexity per token depends on how much text a token holds; the same text's
total negative log-likelihood divided by its UTF-8 bytes does not. Each span
is scored as a completion request sends it (BOS, then the span's tokens), by
the exact forward; the first token after BOS is scored too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from engine.model.base import CausalLM
from engine.model.deepseek_v41.reference import forward
from training.bpe import BOS_ID
from training.trainer import EXACT_KV


def heldout_spans(text: str, count: int, chars: int) -> list[str]:
    """``count`` spans of ``chars`` characters, evenly spaced over ``text``."""
    last = len(text) - chars
    if last < 0 or count < 1:
        raise ValueError(f"{len(text)} characters cannot give {count} x {chars}")
    starts = [round(i * last / max(1, count - 1)) for i in range(count)]
    return [text[s : s + chars] for s in starts]


@torch.no_grad()
def bits_per_byte(model: CausalLM, tokenizer: Tokenizer, spans: list[str]) -> float:
    nats, size = 0.0, 0
    for span in spans:
        ids = torch.tensor([BOS_ID, *tokenizer.encode(span, add_special_tokens=False).ids])
        logits = forward(model, ids, precision=EXACT_KV).logits
        nats += float(F.cross_entropy(logits[:-1], ids[1:], reduction="sum"))
        size += len(span.encode("utf-8"))
    return nats / math.log(2) / size
