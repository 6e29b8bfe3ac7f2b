"""Token logprobs as the API reports them: each token's text and its UTF-8 ``bytes``.

A byte-level BPE token is a run of bytes written in a printable alphabet (one
character per byte, GPT-2's mapping). One token may hold part of a UTF-8
character, so its ``token`` text can only be approximate (U+FFFD for the
partial character, as a lone decode gives); ``bytes`` is exact, and joining the
``bytes`` of every token gives the output's bytes. Added tokens (``</think>``,
``｜DSML｜``) are their own text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenizers import Tokenizer

from engine.api.request import TokenLogprob as EngineLogprob
from server.openai.protocol import CompletionLogprobs, PromptLogprob, TokenLogprob, TopLogprob

# OpenAI reports a token the model cannot produce (masked, banned) as -9999;
# JSON has no -inf.
MIN_LOGPROB = -9999.0


def byte_level_alphabet() -> dict[str, int]:
    """Printable character -> byte of the byte-level BPE alphabet.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes take the
    code points from 256 on, in byte order.
    """
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    char_of = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in char_of.items()}


def clamp_logprob(value: float) -> float:
    return value if math.isfinite(value) and value > MIN_LOGPROB else MIN_LOGPROB


class TokenTexts:
    """Text and bytes of single token ids (cached: the same tokens recur)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._byte_of = byte_level_alphabet()
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        """``(text, bytes)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        added = self._added.get(token_id)
        if added is not None:
            return added, added.encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:  # an id the tokenizer has no entry for (padding rows)
            return "", b""
        # A character outside the alphabet would be a non-byte-level vocabulary: keep its UTF-8.
        raw = b"".join(
            bytes([self._byte_of[c]]) if c in self._byte_of else c.encode() for c in piece
        )
        return raw.decode("utf-8", errors="replace"), raw

    # ------------------------------------------------------------ API shapes
    def chat_entry(self, lp: EngineLogprob) -> TokenLogprob:
        """One ``choices[].logprobs.content[]`` entry."""
        text, raw = self.get(lp.token_id)
        return TokenLogprob(
            token=text,
            logprob=clamp_logprob(lp.logprob),
            bytes=list(raw),
            top_logprobs=[self._top(t, v) for t, v in lp.top_logprobs],
        )

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        text, raw = self.get(token_id)
        return TopLogprob(token=text, logprob=clamp_logprob(logprob), bytes=list(raw))


def extend_completion_logprobs(
    into: CompletionLogprobs,
    texts: TokenTexts,
    logprobs: Sequence[EngineLogprob],
    offset: int,
) -> int:
    """Append the legacy completions logprobs of ``logprobs``; returns the next text offset.

    ``top_logprobs`` is a dict by token text, as OpenAI's: alternatives that
    decode to the same text keep the best logprob.
    """
    for lp in logprobs:
        text = texts.text(lp.token_id)
        into.tokens.append(text)
        into.token_logprobs.append(clamp_logprob(lp.logprob))
        top: dict[str, float] = {}
        for token_id, value in lp.top_logprobs:
            key = texts.text(token_id)
            top[key] = max(top.get(key, MIN_LOGPROB), clamp_logprob(value))
        into.top_logprobs.append(top)
        into.text_offset.append(offset)
        offset += len(text)
    return offset


def extend_prompt_logprobs(
    into: CompletionLogprobs, texts: TokenTexts, token_ids: Sequence[int], offset: int
) -> int:
    """Echoed prompt tokens, listed with no logprob yet: ``serving_completions`` fills
    the values in once the engine has scored the prompt."""
    for token_id in token_ids:
        text = texts.text(token_id)
        into.tokens.append(text)
        into.token_logprobs.append(None)
        into.top_logprobs.append(None)
        into.text_offset.append(offset)
        offset += len(text)
    return offset


def prompt_logprob_entries(
    texts: TokenTexts, scores: Sequence[EngineLogprob], k: int
) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then for each one a
    dict by token id of the token itself and its ``k`` best alternatives."""
    out: list[dict[str, PromptLogprob] | None] = [None]
    for s in scores:
        entry = {
            str(t): PromptLogprob(logprob=clamp_logprob(v), rank=r + 1, decoded_token=texts.text(t))
            for r, (t, v) in enumerate(s.top_logprobs[:k])
        }
        entry[str(s.token_id)] = PromptLogprob(
            logprob=clamp_logprob(s.logprob), rank=s.rank, decoded_token=texts.text(s.token_id)
        )
        out.append(entry)
    return out
