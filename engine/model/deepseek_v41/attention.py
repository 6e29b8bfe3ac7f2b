"""Attention of a V4.1 layer and its CSA2 role (docs/design/architecture.md §1.4, §1.2).

Every layer writes its own SWA KV; a kv source also compresses its rows into
global KV and index keys (``store_kv``). The query side (``forward``) picks the
compressed entries a row attends to by the layer's role: none (SWA only), its
own top-k (Full, Reindex) or its index source's (Reuse). Where the bytes live
and which kernel attends is the ``KVBackend``'s business. Attribute names are
the checkpoint's: ``layers.L.attn.<name>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.model.deepseek_v41.candidates import (
    candidate_block_mask,
    mask_columns,
    select_topk,
    select_topk_among,
)
from engine.model.deepseek_v41.compressor import Compressor
from engine.model.deepseek_v41.config import LayerRole, ModelConfig
from engine.model.deepseek_v41.fp8_linear import linear32
from engine.model.deepseek_v41.grouped_linear import GroupedLinear
from engine.model.deepseek_v41.indexer import Indexer
from engine.model.deepseek_v41.norm import RMSNorm
from engine.model.deepseek_v41.rope import rope_inv_freq, rope_tail
from engine.model.kv.kv_backend import KVBackend
from engine.model.parallel import SINGLE, Parallel


def _linear32(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return linear32(x, layer)  # packed (Fp8Linear) or not


@dataclass(slots=True)
class Selections:
    """CSA2 state of one forward, row-aligned with the rows in flight.

    ``image_rows`` [T] bool: the rows of an image span (their token is the image
    placeholder), whose router picks with ``bias_vl`` and whose Engram gate is
    shut; None for a model without an image token.

    ``topk[l]``: the entries index source ``l`` picked ([T, index_topk], -1 padded),
    which its Reuse layers attend to; ``candidates``: the candidate source's block
    mask, which every later index source scores inside. ``trace`` (tests only)
    receives per layer the positions, picks and candidates.
    """

    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None
    trace: dict[str, dict[int, torch.Tensor]] | None = None
    image_rows: torch.Tensor | None = None

    def keep(self, rows: torch.Tensor) -> None:
        """Follow the backend's row cut."""
        self.topk = {l: t[rows] for l, t in self.topk.items()}
        if self.image_rows is not None:
            self.image_rows = self.image_rows[rows]
        if self.candidates is not None:
            self.candidates = self.candidates[rows]


class Attention(nn.Module):
    """``layers.L.attn``: MQA over one 512-d latent with K = V, a sink per head."""

    inv_freq: torch.Tensor

    def __init__(self, config: ModelConfig, layer_id: int, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.parallel = parallel
        self.role = config.role(layer_id)
        self.kv_source = config.kv_source(layer_id) if self.role is not LayerRole.SWA_ONLY else None
        self.index_source = config.index_source(layer_id)
        self.candidate_source = config.candidate_source_layer_id
        self.index_topk = config.index_topk
        self.candidate_block_size = config.candidate_block_size
        self.candidate_topk_blocks = config.candidate_topk_blocks
        dim, head_dim = config.hidden_size, config.head_dim
        # TP: this rank's query heads and wo_a groups (docs/design/parallelism.md).
        heads = parallel.tp_part(config.num_attention_heads, "num_attention_heads")
        self.n_heads = heads
        self.head_dim = head_dim
        self.o_groups = parallel.tp_part(config.o_groups, "o_groups")
        eps = config.rms_norm_eps
        self.wq_a = nn.Linear(dim, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, eps)
        self.wq_b = nn.Linear(config.q_lora_rank, heads * head_dim, bias=False)
        self.wkv = nn.Linear(dim, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps)
        in_per_group = heads // self.o_groups * head_dim
        self.wo_a = GroupedLinear(in_per_group, config.o_lora_rank, self.o_groups)
        self.wo_b = nn.Linear(self.o_groups * config.o_lora_rank, dim, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(heads, dtype=torch.float32))
        self.compressor = (
            Compressor(config, layer_id) if layer_id in config.kv_source_layer_ids else None
        )
        self.indexer = (
            Indexer(config, layer_id) if layer_id in config.index_source_layer_ids else None
        )
        self.register_buffer("inv_freq", rope_inv_freq(config, layer_id), persistent=False)
        self.softmax_scale = head_dim**-0.5

    # Each projection's output is rounded to the model's dtype, as the release's
    # bf16 linears round it; norms, RoPE and the attention itself compute in fp32.
    # In an fp32 (or float64) model these roundings do nothing.
    def project_q(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, head_dim] RoPE'd at ``positions``, qr = q_norm(wq_a x) [T, q_lora_rank]).

        V4.1 has no per-head q norm (V4 had an unweighted one).
        """
        dtype = x.dtype
        qr = self.q_norm(_linear32(x, self.wq_a).to(dtype))
        q = _linear32(qr, self.wq_b).to(dtype).view(-1, self.n_heads, self.head_dim)
        return rope_tail(q, positions, self.inv_freq), qr

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This token's SWA key/value: kv_norm(wkv x) RoPE'd at ``positions``, [T, head_dim]."""
        kv = self.kv_norm(_linear32(x, self.wkv).to(x.dtype))
        return rope_tail(kv, positions, self.inv_freq)

    def project_out(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention output o [T, H, head_dim] -> [T, D].

        V = K carries RoPE, so the tail is rotated back by -pos first; then
        heads ``g*H/G .. (g+1)*H/G - 1`` go through ``wo_a`` group g, and
        ``wo_b`` mixes the groups.
        """
        dtype = o.dtype
        o = rope_tail(o, positions, self.inv_freq, inverse=True)
        grouped = self.wo_a(o.reshape(o.shape[0], self.o_groups, -1)).to(dtype)
        # TP: each rank's wo_b sees its groups only; the sum over ranks is the output.
        return self.parallel.tp_all_reduce(_linear32(grouped.flatten(1), self.wo_b)).to(dtype)

    # ------------------------------------------------------------ forward
    def store_kv(self, x: torch.Tensor, kv: KVBackend) -> None:
        """Write this layer's KV for every row in flight: its SWA key/value and, at a
        kv source, the compressed entries of every group that completes."""
        pos = kv.positions
        raw = self.compressor.project(x) if self.compressor is not None else None
        self.store_projected(self.project_kv(x, pos), raw, x.dtype, kv)

    def store_projected(
        self, swa_kv: torch.Tensor, raw: torch.Tensor | None, dtype: torch.dtype, kv: KVBackend
    ) -> None:
        """``store_kv`` from the row-wise projections (``project_kv``, ``Compressor.project``):
        the part that needs the backend (a decode graph runs the projections captured)."""
        kv.store_swa(self.layer_id, swa_kv)
        if self.compressor is None:
            return
        assert raw is not None
        ratio = self.compressor.ratio
        rows, entry_ids = kv.compressor_groups(self.layer_id, raw, ratio)
        if entry_ids.numel() == 0:
            return
        latent = self.compressor.combine(rows, dtype)  # un-RoPE'd
        entry_pos = entry_ids * ratio  # each entry sits at its group's first position
        assert self.indexer is not None, "every kv source is an index source"
        kv.store_global(
            self.layer_id,
            entry_ids,
            rope_tail(latent, entry_pos, self.inv_freq),
            self.indexer.keys(latent, entry_pos),
        )

    def forward(self, x: torch.Tensor, kv: KVBackend, sel: Selections) -> torch.Tensor:
        """The query side: ``x`` [T, D] (attention input) -> output [T, D]."""
        pos = kv.positions
        q, qr = self.project_q(x, pos)
        queries = None
        if self.picks_own and self.indexer is not None:
            queries = self.indexer.queries(qr, x, pos)
        return self.project_out(self.attend_projected(q, queries, kv, sel), pos)

    @property
    def picks_own(self) -> bool:
        """Whether this layer scores its own top-k (Full, Reindex): it needs index queries."""
        return self.role not in (LayerRole.SWA_ONLY, LayerRole.REUSE)

    def attend_projected(
        self,
        q: torch.Tensor,
        queries: tuple[torch.Tensor, torch.Tensor] | None,
        kv: KVBackend,
        sel: Selections,
    ) -> torch.Tensor:
        """The query side from the row-wise projections (``project_q``, ``Indexer.queries``
        when ``picks_own``): selection and attention, before ``project_out``."""
        pos = kv.positions
        if self.role is LayerRole.SWA_ONLY:
            picked = None
        elif self.role is LayerRole.REUSE:
            assert self.index_source is not None
            picked = sel.topk[self.index_source]
        else:
            assert queries is not None
            picked = self._pick(*queries, kv, sel)
        if sel.trace is not None and picked is not None:
            sel.trace.setdefault("topk", {})[self.layer_id] = picked
            sel.trace.setdefault("pos", {})[self.layer_id] = pos
            if sel.candidates is not None:
                sel.trace.setdefault("candidates", {})[self.layer_id] = sel.candidates
        return kv.attend(
            self.layer_id, q, self.kv_source, picked, self.attn_sink, self.softmax_scale
        )

    def _pick(
        self, qi: torch.Tensor, w: torch.Tensor, kv: KVBackend, sel: Selections
    ) -> torch.Tensor:
        """An index source's own top-k (Full, Reindex), published for its Reuse layers.

        The candidate source scores densely and publishes its candidate blocks;
        every index source after it picks only inside them.
        """
        assert self.indexer is not None and self.kv_source is not None
        if sel.candidates is not None and self.layer_id > self.candidate_source:
            # Only the candidate blocks' entries can be picked, and they are all
            # visible (``candidate_block_mask``): score just those, so this layer's
            # work does not grow with the context.
            width = self.candidate_block_size * self.candidate_topk_blocks
            entries = mask_columns(sel.candidates, min(width, sel.candidates.shape[1]))
            scores = kv.index_scores_at(self.kv_source, qi, w, self.indexer.score_scale, entries)
            picked = select_topk_among(scores, entries, self.index_topk)
            sel.topk[self.layer_id] = picked
            return picked
        scores, visible = kv.index_scores(self.kv_source, qi, w, self.indexer.score_scale)
        allowed = visible
        if self.layer_id == self.candidate_source:
            sel.candidates = candidate_block_mask(
                scores, visible, self.candidate_block_size, self.candidate_topk_blocks
            )
        picked = select_topk(scores, allowed, self.index_topk)
        sel.topk[self.layer_id] = picked
        return picked
