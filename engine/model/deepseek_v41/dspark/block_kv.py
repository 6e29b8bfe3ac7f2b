"""The KV a drafting round attends over: each stage's context ring plus the block.

A DSpark block runs through ordinary V4.1 blocks (``Block.forward``), which
reach their KV through the ``KVBackend`` protocol. For the drafter that is: the
stage's ring of context KV (projected from the target features of committed
rows) followed by the block's own rows, every query seeing all of them (no
causal mask inside the block, no window cut: the ring already is the window).
The stages are sliding-window only, so the compressed-KV methods are never
called; they refuse.
"""

from __future__ import annotations

import torch

from engine.model.deepseek_v41.sink_attention import sink_attention


class DraftBlockKV:
    """The rounds of N sequences at once: ``positions`` [N * B] of the block rows,
    sequence-major (sequence i's block is rows ``i*B .. i*B + B - 1``), and per
    sequence ``rings[i][layer_id]`` [S_i, head_dim] (RoPE'd context KV, S_i <= window).
    A block row sees its own sequence's ring and block only (a block-diagonal mask
    over the concatenated keys), so a batch of one is the single round exactly."""

    def __init__(
        self, positions: torch.Tensor, rings: list[dict[int, torch.Tensor]], block_size: int
    ) -> None:
        assert positions.shape[0] == len(rings) * block_size
        self._positions = positions
        self._rings = rings
        self._block_size = block_size
        self._block: dict[int, torch.Tensor] = {}

    @property
    def positions(self) -> torch.Tensor:
        return self._positions

    def keep_rows(self, layer_id: int) -> torch.Tensor | None:
        return None

    def token_windows(self, n: int) -> torch.Tensor:
        raise NotImplementedError("DSpark stages have no Engram")

    def store_swa(self, layer_id: int, kv: torch.Tensor) -> None:
        # The block's own KV lives for this round only: rings hold committed rows.
        self._block[layer_id] = kv

    def compressor_groups(
        self, layer_id: int, raw: torch.Tensor, ratio: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("DSpark stages do not compress")

    def store_global(
        self, layer_id: int, entry_ids: torch.Tensor, latent: torch.Tensor, index_key: torch.Tensor
    ) -> None:
        raise NotImplementedError("DSpark stages do not compress")

    def index_scores(
        self, source_id: int, qi: torch.Tensor, weights: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("DSpark stages have no indexer")

    def index_scores_at(
        self,
        source_id: int,
        qi: torch.Tensor,
        weights: torch.Tensor,
        scale: float,
        entries: torch.Tensor,
    ) -> torch.Tensor:
        raise NotImplementedError("DSpark stages have no indexer")

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        source_id: int | None,
        selection: torch.Tensor | None,
        sink: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        assert source_id is None and selection is None, "DSpark stages are SWA only"
        block = self._block[layer_id]
        rings = [ring[layer_id].to(block.dtype) for ring in self._rings]
        keys = torch.cat([*rings, block])
        n, device = len(rings), q.device
        # Which sequence each query row and each key belongs to.
        row_owner = torch.arange(n, device=device).repeat_interleave(self._block_size)
        ring_sizes = torch.tensor([r.shape[0] for r in rings], device=device)
        key_owner = torch.cat(
            [torch.arange(n, device=device).repeat_interleave(ring_sizes), row_owner]
        )
        mask = row_owner[:, None] == key_owner[None, :]
        return sink_attention(q, keys, mask, sink, scale)

    def logit_rows(self) -> torch.Tensor | None:
        return None
