"""Append BPE merges to a trained tokenizer, learnt on new text, without retraining it.

The demo's tokenizer was trained on the plays only, so JSON and tool-call
syntax (``{"``, ``":``, ``"type":``) costs about a token per character. GPT-2's
pre-tokenizer already keeps a run of punctuation (with an optional leading
space) in one piece; the plays simply never earned those merges. Continuing
BPE on tool-call text, starting from each word as the current merges leave
it, and appending the new merges after the old ones keeps every old merge's
rank: BPE applies merges lowest rank first, so a word tokenises exactly as
before unless one of the appended merges fires on what the old ones leave.
Old ids keep their numbers; new ones follow them.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Iterable

from tokenizers import Tokenizer

from training.bpe import SPECIAL_TOKENS


def word_pieces(tokenizer: Tokenizer, texts: Iterable[str]) -> Counter[tuple[str, ...]]:
    """Each pre-tokenised word of ``texts`` as the current merges split it, with its count.

    Added tokens (the chat markers) are words of their own and never merged.
    """
    specials = {token for token, _ in SPECIAL_TOKENS}
    words: Counter[tuple[str, ...]] = Counter()
    for text in texts:
        encoding = tokenizer.encode(text, add_special_tokens=False)
        current: list[str] = []
        last_word: int | None = None
        for token, word in zip(encoding.tokens, encoding.word_ids, strict=True):
            if token in specials or word != last_word:
                if len(current) > 1:
                    words[tuple(current)] += 1
                current = []
            last_word = None if token in specials else word
            if token not in specials:
                current.append(token)
        if len(current) > 1:
            words[tuple(current)] += 1
    return words


def learn_merges(
    words: Counter[tuple[str, ...]], new_ids: int, existing: set[str], min_frequency: int = 2
) -> list[tuple[str, str]]:
    """BPE merges on ``words`` until ``new_ids`` new tokens exist (or no pair repeats).

    A merge whose result is already a token (reached before by another split)
    is kept and adds no id. Ties go to the lexicographically first pair, so the
    result is deterministic.
    """
    merges: list[tuple[str, str]] = []
    vocab = set(existing)
    added = 0
    work = dict(words)
    while added < new_ids:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in work.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best, freq = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if freq < min_frequency:
            break
        merges.append(best)
        joined = best[0] + best[1]
        if joined not in vocab:
            vocab.add(joined)
            added += 1
        work = {_merge(word, best, joined): count for word, count in work.items()}
    return merges


def _merge(word: tuple[str, ...], pair: tuple[str, str], joined: str) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(joined)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def extend_tokenizer(tokenizer: Tokenizer, texts: Iterable[str], new_ids: int) -> Tokenizer:
    """``tokenizer`` with merges learnt on ``texts`` appended, adding ``new_ids`` ids at the end.

    Raises if ``texts`` cannot supply that many merges.
    """
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges = learn_merges(word_pieces(tokenizer, texts), new_ids, set(vocab))
    next_id = max(vocab.values()) + 1
    for left, right in merges:
        joined = left + right
        if joined not in vocab:
            vocab[joined] = next_id
            next_id += 1
    data["model"]["merges"] = [*data["model"]["merges"], *[list(m) for m in merges]]
    extended = Tokenizer.from_str(json.dumps(data))
    size = extended.get_vocab_size(with_added_tokens=True)
    want = tokenizer.get_vocab_size(with_added_tokens=True) + new_ids
    if size != want:
        raise ValueError(f"the texts gave {size - want + new_ids} new ids, wanted {new_ids}")
    return extended


def base_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> Tokenizer:
    """``tokenizer`` cut back to its first ``vocab_size`` ids and the merges that made them.

    For a tokenizer from ``extend_tokenizer``: the one it was extended from (whose
    merges each made one id beyond the byte alphabet and the special tokens).
    """
    data = json.loads(tokenizer.to_str())
    model = data["model"]
    model["vocab"] = {k: v for k, v in model["vocab"].items() if v < vocab_size}
    model["merges"] = model["merges"][: vocab_size - 256 - len(SPECIAL_TOKENS)]
    return Tokenizer.from_str(json.dumps(data))
