"""Where KV lives and which kernels attend: the model's one door to storage.

``DeepseekV41.forward`` is the only layer loop. It asks a ``KVBackend`` for the
things that depend on where bytes live, and for nothing else:

- which rows are in flight (their positions), and which of them go on past a
  layer's KV writes (``keep_rows``: the replay plan's cut);
- each row's last n token ids (Engram's n-grams reach across chunk boundaries);
- storing a layer's SWA KV, grouping a kv source's compressor rows (an open
  group may have begun in an earlier step) and storing its compressed entries;
- index scores of queries against a kv source's stored keys (all of them, or a
  listed few per row);
- attention over the SWA window plus a selection of compressed entries.

Two implementations: ``engine.model.kv.dense_backend.DenseKV`` (whole sequence,
masked dense attention; the oracle and the training path) and the engine's
``engine.runner.paged_backend.PagedKV`` (pages, SWA rings, ``kernels/``). The model
code around these calls (projections, RoPE, quantisation points of the
release, CSA2 role dispatch, selection, mHC, MoE, Engram) is shared.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVBackend(Protocol):
    """One forward pass over a batch of rows (one or more sequences)."""

    @property
    def positions(self) -> torch.Tensor:
        """LongTensor [T]: the position of every row in flight."""
        ...

    def keep_rows(self, layer_id: int) -> torch.Tensor | None:
        """After layer ``layer_id``'s KV writes: indices of the rows whose query side
        runs (the rows the next layer needs); None when every row goes on.
        The backend drops the others from its own row state."""
        ...

    def token_windows(self, n: int) -> torch.Tensor:
        """LongTensor [T, n]: token ids at positions ``p - n + 1 .. p`` of each row;
        -1 before the sequence start."""
        ...

    def store_swa(self, layer_id: int, kv: torch.Tensor) -> None:
        """This layer's SWA key/value of every row in flight ([T, head_dim], RoPE'd)."""
        ...

    def compressor_groups(
        self, layer_id: int, raw: torch.Tensor, ratio: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Complete compressor groups that start at or after the stored prefix.

        ``raw`` [T, width] is ``Compressor.project`` of every row in flight.
        Returns (rows [k * ratio, width], entry ids [k]); rows of a group still
        open are kept as compressor state for a later step.
        """
        ...

    def store_global(
        self, layer_id: int, entry_ids: torch.Tensor, latent: torch.Tensor, index_key: torch.Tensor
    ) -> None:
        """New compressed entries of kv source ``layer_id``: RoPE'd latents [k, head_dim]
        and index keys [k, index_head_dim], stored in the backend's formats."""
        ...

    def index_scores(
        self, source_id: int, qi: torch.Tensor, weights: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores [T, S] fp32, visible [T, S] bool) of queries ``qi`` [T, h, d] with head
        weights [T, h] against kv source ``source_id``'s index keys:
        ``sum_h w[t, h] (relu(qi[t, h] . k[s]) scale)``; entry ``s`` visible iff
        ``s < (pos + 1) // ratio``."""
        ...

    def index_scores_at(
        self,
        source_id: int,
        qi: torch.Tensor,
        weights: torch.Tensor,
        scale: float,
        entries: torch.Tensor,
    ) -> torch.Tensor:
        """Scores [T, K] fp32 of the listed entries ``entries`` [T, K] (-1 padded: -inf there)
        of kv source ``source_id``, the same formula as ``index_scores``; the entries
        are visible to their row (the caller's contract)."""
        ...

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        source_id: int | None,
        selection: torch.Tensor | None,
        sink: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Sink attention of ``q`` [T, H, d] over the row's SWA window of this layer and
        the selected entries ([T, k], -1 padded) of ``source_id``'s latents."""
        ...

    def logit_rows(self) -> torch.Tensor | None:
        """Indices of the rows whose logits the caller wants; None for every row."""
        ...
