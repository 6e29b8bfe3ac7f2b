"""Incremental detokenization with stop strings.

Byte-level BPE tokens are not characters: one emoji can span four tokens, and
a token's text can depend on its neighbours. So each step decodes a short
trailing window of ids twice, ``ids[prefix:read]`` (text already emitted) and
``ids[prefix:]``, and emits the difference only when it does not end in
U+FFFD (an unfinished UTF-8 character). Then ``prefix`` moves to ``read`` and
``read`` to the end.

Stop strings: the longest tail of the not-yet-emitted text that could begin a
stop string is held back, so a stop string split across tokens is never
streamed; once one appears, the output ends just before it (or just after it
with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from engine.api.sampling_params import SamplingParams
from engine.api.special_tokens import partial_tag_tail

# Prompt tokens decoded before the first output token, so the first window
# starts on a clean character boundary (vLLM uses the same 5).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(slots=True)
class DetokDelta:
    text: str  # new text to stream (may be empty)
    stopped: bool = False  # a stop string was found; ``text`` is the last piece
    stop_reason: str | None = None  # the stop string that matched


def check_stop_token(token_id: int, params: SamplingParams, eos_id: int | None) -> str | None:
    """``"stop"`` if ``token_id`` ends the sequence (EOS unless ignored, or a stop id)."""
    if eos_id is not None and token_id == eos_id and not params.ignore_eos:
        return "stop"
    if token_id in params.stop_token_ids:
        return "stop"
    return None


class IncrementalDetokenizer:
    """Turns one sequence's output ids into streamed text, one token at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = list(stop)
        self._include_stop = include_stop_str_in_output
        # Stop strings are looked for only after `min_tokens` output tokens.
        self._min_tokens = min_tokens
        # Only the ids from `_prefix` on are kept; the offsets index this list.
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._pending = ""  # decoded, not yet emitted (held back for stop strings)
        self._emitted: list[str] = []
        self.num_tokens = 0
        self.finished = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    def push(self, token_id: int) -> DetokDelta:
        """Add one output token; return the text that is now safe to stream."""
        assert not self.finished, "push after a stop or flush"
        self._ids.append(token_id)
        self.num_tokens += 1
        full = self._decode(self._ids[self._prefix :])
        if len(full) > len(self._prefix_text) and not full.endswith(_REPLACEMENT_CHAR):
            self._pending += full[len(self._prefix_text) :]
            self._advance()
        return self._release()

    def flush(self) -> str:
        """The rest of the text when generation ends without a stop string."""
        if self.finished:
            return ""
        # Whatever is decodable now, unfinished characters included (as U+FFFD).
        full = self._decode(self._ids[self._prefix :])
        rest = self._pending + full[len(self._prefix_text) :]
        self._pending = ""
        self.finished = True
        self._emitted.append(rest)
        return rest

    # ---------------------------------------------------------------- internals

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _advance(self) -> None:
        """Move the window: the new prefix is what was just read."""
        self._prefix_text = self._decode(self._ids[self._read :])
        del self._ids[: self._read]
        self._prefix = 0
        self._read = len(self._ids)

    def _release(self) -> DetokDelta:
        """Emit pending text, stopping at or holding back for stop strings."""
        if not self._stop or self.num_tokens <= self._min_tokens:
            return self._emit(len(self._pending))
        match = self._find_stop(self._pending)
        if match is not None:
            start, stop = match
            end = start + len(stop) if self._include_stop else start
            delta = self._emit(end)
            self._pending = ""
            self.finished = True
            return DetokDelta(delta.text, stopped=True, stop_reason=stop)
        # No stop string is in the pending text (else it matched above): hold back
        # the tail that could still become one.
        return self._emit(len(self._pending) - partial_tag_tail(self._pending, self._stop))

    def _emit(self, end: int) -> DetokDelta:
        text, self._pending = self._pending[:end], self._pending[end:]
        self._emitted.append(text)
        return DetokDelta(text)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string that occurs first (the shorter on a tie), with its start."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0 and (best is None or (start, len(stop)) < (best[0], len(best[1]))):
                best = (start, stop)
        return best
