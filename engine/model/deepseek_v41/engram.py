"""Engram conditional memory: hashed n-gram tables gated into mHC copies.

See docs/design/architecture.md §1.9.

Three steps, one section each:
1. token id -> compressed class (tokens that normalise alike share a class);
2. the classes of the last ``max_ngram`` tokens -> one table row per
   (n-gram order, head), by an XOR-of-products hash modulo a per-head prime;
3. the rows -> ``wkv`` -> one key per copy plus a shared value; a sigmoid
   gate per copy adds the value to that copy of the residual stream.
Decisions where sources are silent are in docs/design/model-notes.md.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, normalizers
from torch import nn

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.engram_table import MappedEngramTable
from engine.model.precision import upcast

# ----------------------------------------------------------- compressed vocabulary

# Decoding a lone byte of a multi-byte UTF-8 character yields U+FFFD.
_REPLACEMENT_CHAR = "\ufffd"

# NFKC, NFD, strip accents, lowercase, collapse ASCII whitespace runs to one space.
_FOLD = normalizers.Sequence(
    [
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
    ]
)
_STRIP = normalizers.Strip()


def compression_key(text: str, raw_token: str) -> str:
    """The string that decides a token's class.

    ``text`` is the token decoded alone, ``raw_token`` its vocabulary entry.
    A partial UTF-8 byte has nothing to normalise and keeps its raw form; a
    token that folds to a single space stays " " (stripping would merge it
    with the empty string); a token that folds to nothing keeps its text.
    """
    if _REPLACEMENT_CHAR in text:
        return raw_token
    folded = _FOLD.normalize_str(text)
    if folded != " ":
        folded = _STRIP.normalize_str(folded)
    return folded or text


# Compressed maps by sha256 of the tokenizer's JSON: a `Tokenizer` carries no
# path, and hashing its content (~70 ms) is far cheaper than rebuilding (~0.6 s).
_VOCAB_CACHE: dict[str, tuple[torch.Tensor, int]] = {}


def build_compressed_vocab(tokenizer: Tokenizer) -> tuple[torch.Tensor, int]:
    """``(class_of [V] int64, n_classes)``: classes numbered by first appearance over ids 0..V-1.

    Cached per tokenizer content; each call returns its own copy of the map.
    """
    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    if digest not in _VOCAB_CACHE:
        _VOCAB_CACHE[digest] = _compress_vocab(tokenizer)
    class_of, n_classes = _VOCAB_CACHE[digest]
    return class_of.clone(), n_classes


def _compress_vocab(tokenizer: Tokenizer) -> tuple[torch.Tensor, int]:
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    class_by_key: dict[str, int] = {}
    class_of = [
        class_by_key.setdefault(
            compression_key(text, tokenizer.id_to_token(i) or ""), len(class_by_key)
        )
        for i, text in enumerate(texts)
    ]
    return torch.tensor(class_of, dtype=torch.long), len(class_by_key)


# -------------------------------------------------------------------- n-gram hash


@functools.lru_cache(maxsize=64)
def engram_multipliers(
    layer_id: int, max_ngram_size: int, compressed_vocab_size: int
) -> tuple[int, ...]:
    """One odd multiplier per look-back ``0 .. max_ngram_size-1`` (same for every head).

    Drawn as ``default_rng(10007 * layer_id).integers(0, B, max_ngram_size, int64) * 2 + 1``
    with ``B = (int64_max // compressed_vocab_size) // 2``, so a class times a
    multiplier never overflows int64.
    """
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    draws = rng.integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in draws)


def engram_layer_primes(config: ModelConfig, layer_id: int) -> list[int]:
    """The layer's moduli, order-major then head-minor (``n_orders * n_heads``)."""
    return config.engram_primes()[config.engram_layer_ids.index(layer_id)]


def engram_offsets(primes: list[int]) -> list[int]:
    """First table row of each (order, head): exclusive cumulative sums of the primes."""
    return [sum(primes[:i]) for i in range(len(primes))]


def engram_hash_rows(compressed: torch.Tensor, config: ModelConfig, layer_id: int) -> torch.Tensor:
    """Table rows ``[T, n_orders * n_heads]`` for the last ``T`` positions of ``compressed``.

    ``compressed [T + max_ngram - 1]`` holds the classes of the positions, the
    first ``max_ngram - 1`` entries being the history before the first one
    (the pad class for positions < 0).
    """
    n = config.engram_max_ngram_size
    assert compressed.shape[0] >= n - 1, "compressed ids must include max_ngram_size - 1 history"
    return engram_hash_windows(compressed.long().unfold(0, n, 1), config, layer_id)


def engram_hash_windows(windows: torch.Tensor, config: ModelConfig, layer_id: int) -> torch.Tensor:
    """Table rows ``[T, n_orders * n_heads]`` of positions whose last ``max_ngram`` classes
    are ``windows [T, max_ngram]`` (the position's own class last).

    For an n-gram ending at ``t``: ``h = XOR_{k < n} class[t - k] * mult[k]``;
    row = ``h % prime + offset``.
    """
    n = config.engram_max_ngram_size
    n_heads = config.engram_n_heads
    classes = windows.long()
    assert classes.shape[1:] == (n,), (classes.shape, n)
    assert classes.numel() == 0 or (
        int(classes.min()) >= 0 and int(classes.max()) < config.engram_compressed_vocab_size
    ), "compressed class out of range: the multiplier bound assumes class < compressed vocab"
    mult = engram_multipliers(layer_id, n, config.engram_compressed_vocab_size)
    primes = engram_layer_primes(config, layer_id)
    device = windows.device
    prime_t = torch.tensor(primes, dtype=torch.long, device=device).view(n - 1, n_heads)
    offset_t = torch.tensor(engram_offsets(primes), dtype=torch.long, device=device).view(
        n - 1, n_heads
    )
    rolling = torch.zeros(classes.shape[0], dtype=torch.long, device=device)
    columns = []
    for k in range(n):  # look-back k; after it, `rolling` hashes the (k+1)-gram
        rolling = rolling ^ (classes[:, n - 1 - k] * mult[k])
        if k >= 1:
            columns.append(rolling[:, None] % prime_t[k - 1] + offset_t[k - 1])
    return torch.cat(columns, dim=-1)


# ------------------------------------------------------------------- the module

# The gate's signed square root floors |dot| here (the training kernel's value).
GATE_FLOOR = 1e-6


def engram_gate(
    R: torch.Tensor,
    key: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Gate ``[T, hc]`` (fp32) of each copy ``R [T, hc, D]`` against its key ``[T, hc, D]``.

    ``s = sum(rms(R) q_weight * rms(key) k_weight) / sqrt(D)``;
    ``gate = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))`` with sign(0) = +.
    """
    dim = R.shape[-1]
    r, k = upcast(R), upcast(key)
    # The release's order: one dot of R, the weights' product and the key, then both
    # inverse RMS and 1/sqrt(D) (fp32 rounds it differently from normalising first).
    weight = upcast(q_weight) * upcast(k_weight)
    inv_rms = torch.rsqrt(r.square().mean(dim=-1) + eps) * torch.rsqrt(
        k.square().mean(dim=-1) + eps
    )
    dot = (r * weight * k).sum(dim=-1) * inv_rms * dim**-0.5
    magnitude = dot.abs().clamp(min=GATE_FLOOR).sqrt()
    return torch.sigmoid(torch.copysign(magnitude, dot))


# While set, Engram modules build their table on ``meta`` (no bytes anywhere):
# a loader that maps the tables from the checkpoint never fills the parameter.
_TABLES_ON_META: ContextVar[bool] = ContextVar("engram_tables_on_meta", default=False)


@contextmanager
def tables_on_meta() -> Iterator[None]:
    """Build ``Engram`` modules whose ``embed`` table is a ``meta`` tensor."""
    token = _TABLES_ON_META.set(True)
    try:
        yield
    finally:
        _TABLES_ON_META.reset(token)


class Engram(nn.Module):
    """Engram of layer ``layer_id``; parameters under ``layers.L.engram.*``.

    ``embed.weight [rows, head_dim]`` is the hash table (FP8 with per-row
    scales per 32 in the checkpoint): either an in-memory parameter the loader
    fills with the dequantised rows (training, tiny models), or, after
    ``use_mapped_table``, no parameter at all and a ``MappedEngramTable`` that
    gathers each step's rows from the memory-mapped checkpoint. ``wkv.weight
    [(hc + 1) * D, n_orders * n_heads * head_dim]`` makes ``hc`` keys and one
    value, ``q_weight`` / ``k_weight [hc, D]`` weight the gate's dot product.
    """

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        if layer_id not in config.engram_layer_ids:
            raise ValueError(f"layer {layer_id} is not an Engram layer {config.engram_layer_ids}")
        index = config.engram_layer_ids.index(layer_id)
        self.layer_id = layer_id
        self.hc = config.hc_mult
        self.dim = config.hidden_size
        self.eps = config.rms_norm_eps
        self.n_columns = len(config.engram_orders) * config.engram_n_heads
        meta = "meta" if _TABLES_ON_META.get() else None
        self.embed: nn.Embedding | None = nn.Embedding(
            config.engram_num_embeddings[index], config.engram_head_dim, device=meta
        )
        self.table: MappedEngramTable | None = None
        self.wkv = nn.Linear(
            self.n_columns * config.engram_head_dim, (self.hc + 1) * self.dim, bias=False
        )
        self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim))
        self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim))

    def use_mapped_table(self, table: MappedEngramTable) -> None:
        """Look rows up in ``table`` from now on; the ``embed`` parameter is dropped
        (it leaves ``state_dict``), so no copy of the table lives in the model."""
        if self.embed is not None and tuple(self.embed.weight.shape) != table.shape:
            raise ValueError(
                f"layer {self.layer_id}: table shape {list(table.shape)}, "
                f"expected {list(self.embed.weight.shape)}"
            )
        self.embed = None
        self.table = table

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Table rows ``[T, n_columns, head_dim]`` for ``row_ids [T, n_columns]``."""
        if self.table is not None:
            return self.table.rows(row_ids, device=self.q_weight.device)
        assert self.embed is not None
        return F.embedding(row_ids, self.embed.weight)

    def apply_rows(
        self, R: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``R'[h] = R[h] + gate_h * value`` from looked-up ``rows``; in fp32, ``R``'s dtype out.

        ``live [T]`` bool: False shuts the gate (an image position passes through untouched).
        """
        kv = self.wkv(rows.flatten(-2).to(self.q_weight.dtype))  # wkv may be packed (FP8)
        key = kv[..., : self.hc * self.dim].unflatten(-1, (self.hc, self.dim))
        value = kv[..., self.hc * self.dim :]
        gate = engram_gate(R, key, self.q_weight, self.k_weight, self.eps)
        if live is not None:
            gate = gate.masked_fill(~live[:, None], 0.0)
        return (upcast(R) + gate.unsqueeze(-1) * upcast(value).unsqueeze(-2)).to(R.dtype)

    def forward(
        self, R: torch.Tensor, row_ids: torch.Tensor, live: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``R [T, hc, D]``, ``row_ids [T, n_columns]`` (from ``engram_hash_rows``) -> ``R'``."""
        return self.apply_rows(R, self.lookup(row_ids), live)
