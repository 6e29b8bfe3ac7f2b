"""DeepSeek-V4.1's special tokens and tags as text, and the hold-back for partial tags.

This is their one home. It sits in ``engine.api`` because both sides of the
layering read it: the engine (the grammar compiler keeps ``<think>``,
``</think>`` and ``｜DSML｜`` open under a grammar; the detokenizer holds back
stop strings) and the server (the chat template writes them; the reasoning and
tool-call parsers split on them), and the server may import ``engine.api`` but
nothing deeper. The strings are the tokenizer's added tokens, so they are facts
of the model's vocabulary, not of the HTTP API.

``partial_tag_tail`` is the one implementation of "the longest tail of a text
that could still grow into a tag": a streaming parser keeps that tail back
until the next delta says whether the tag comes, so a tag split across deltas
is never streamed as text.
"""

from __future__ import annotations

from collections.abc import Iterable

# Turn and document markers (the chat template, engine/loader and training agree on them).
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
FIM_HOLE = "<｜fim▁hole｜>"
FIM_BEGIN = "<｜fim▁begin｜>"
FIM_END = "<｜fim▁end｜>"

# Reasoning: the prompt opens ``<think>``; the first ``</think>`` (token 128822) ends it.
THINK_START = "<think>"
THINK_END = "</think>"

# DSML tool calls (``｜DSML｜`` is token 128825); server/chat/tool_calls.py shows a block.
DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML} calls>"
CALLS_CLOSE = f"</{DSML} calls>"
INVOKE_OPEN = f'<{DSML} invoke name="'  # + name + '">'
INVOKE_CLOSE = f"</{DSML} invoke>"
PARAM_OPEN = f'<{DSML} parameter name="'  # + key + '" string="true|false">'
PARAM_CLOSE = f"</{DSML} parameter>"

# Added tokens a grammar may produce (the reasoning and calls formats use them); every
# other added token is masked out under a grammar.
GRAMMAR_MARKERS = (THINK_START, THINK_END, DSML)


def partial_tag_tail(text: str, tags: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``tags``.

    A proper prefix: a whole tag in the tail is the caller's to find (it ends the
    text there), so only an unfinished one is held back. Tags must be non-empty.
    """
    candidates = list(tags)
    longest = min(len(text), max((len(t) for t in candidates), default=1) - 1)
    for n in range(longest, 0, -1):
        tail = text[-n:]
        if any(len(t) > n and t.startswith(tail) for t in candidates):
            return n
    return 0
