"""Split generated text into ``reasoning_content`` and ``content`` at ``</think>``.

With thinking on, the prompt ends in ``<think>``, so the model's first text is
reasoning; the first ``</think>`` ends it and everything after is the answer.
``</think>`` is one token (128822) but arrives as text, possibly split across
deltas; the parser holds back any tail that could begin it, so a partial
``</think>`` is never streamed as reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.api.special_tokens import THINK_END, partial_tag_tail


@dataclass(slots=True)
class ReasoningParser:
    """Incremental splitter: ``feed`` returns ``(reasoning_delta, content_delta)``."""

    in_reasoning: bool = True  # the output starts inside <think>
    _held: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        buf = self._held + text
        end = buf.find(THINK_END)
        if end >= 0:
            self.in_reasoning = False
            self._held = ""
            return buf[:end], buf[end + len(THINK_END) :]
        keep = partial_tag_tail(buf, [THINK_END])
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        """Flush at the end of generation: a held partial tag was reasoning after all."""
        held, self._held = self._held, ""
        return held, ""
