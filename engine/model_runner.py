"""The production model runner: paged FP4 global KV, per-request SWA rings, one pass per step.

Every step runs the rows of all scheduled sequences together through the
layer loop (docs/design/semantics.md):

- a prefill chunk's rows go through the encoder and layer B's KV writes; the
  rows at or past the sequence's decoder start ``d0`` continue through layer
  B's query side and the decoder (bounded replay, chunk by chunk);
- a decode row is a chunk of one row that runs every layer.

Row-wise work (mHC, norms, projections, MoE, Engram) is batched over all rows;
attention and the indexer run per sequence through ``kernels/`` (PyTorch
references on CPU, Triton on GPU). Global KV lives in the KV store's pages as
FP4 records and MXFP4 index keys; SWA windows live in the request-state rings
as MXFP8 records. The dense oracle is ``engine/model/reference.py``; the engine
tests hold the two together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.candidates import candidate_block_mask, select_topk, visible_entries
from engine.model.config import LayerRole
from engine.model.mhc import hc_collapse, hc_mix
from engine.model.model import DeepseekV41
from engine.model.precision import upcast
from engine.model.rope import rope_tail
from engine.runner import StepBatch
from engine.sequence import Sequence
from kernels.indexer_ops import indexer_scores
from kernels.kv_cache_ops import store_kv_entries
from kernels.kv_formats import dequantize_swa, quantize_swa
from kernels.sparse_attention import sparse_attention
from kvstore.manager import KVCacheManager
from kvstore.request_state import RequestStateLayout, RequestStatePool


@dataclass(slots=True)
class _Segment:
    """Rows ``[start, end)`` of one sequence in this step, at ``offset`` in the row batch."""

    seq: Sequence
    start: int
    end: int
    wants_logits: bool
    offset: int = 0

    @property
    def rows(self) -> int:
        return self.end - self.start


class PagedModelRunner:
    """Implements ``engine.runner.ModelRunner`` over a ``KVCacheManager``."""

    def __init__(self, model: DeepseekV41, kv: KVCacheManager, max_num_seqs: int) -> None:
        self.model = model
        self.config = config = model.config
        self.kv = kv
        self.device = model.embed.weight.device
        self.boundary = config.ced_boundary
        self.window = config.sliding_window
        self.ratios = {l: config.compress_ratios[l] for l in config.kv_source_layer_ids}
        grouped = [l for l in config.kv_source_layer_ids if self.ratios[l] > 1]
        self.pending_index = {l: i for i, l in enumerate(grouped)}  # compressor state slots
        self.states = RequestStatePool(
            RequestStateLayout.for_model(
                swa_layers=config.num_hidden_layers,
                sliding_window=config.sliding_window,
                kv_source_ratios=[self.ratios[l] for l in config.kv_source_layer_ids],
                head_dim=config.head_dim,
            ),
            max_num_seqs,
            device=str(self.device),
        )
        self.pages = {l: kv.page_tensors(l) for l in config.kv_source_layer_ids}
        self._has_state: set[int] = set()

    # ------------------------------------------------------------ protocol
    def release(self, seq: Sequence) -> None:
        if seq.seq_id in self._has_state:
            self._has_state.discard(seq.seq_id)
            self.states.free(seq.seq_id)

    @torch.no_grad()
    def execute(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        segments = [_Segment(s, s.num_tokens - 1, s.num_tokens, True) for s in batch.decodes]
        segments += [
            _Segment(c.seq, c.start, c.end, c.last and not c.seq.prefill_only)
            for c in batch.prefills
            if c.end > c.start  # a prefill-only chunk whose pages all hit runs nothing
        ]
        if not segments:
            return {}
        if self.model.encoder_only and not all(s.seq.prefill_only for s in segments):
            raise RuntimeError("an encoder-only model cannot run decoder rows")
        for seg in segments:
            if seg.seq.seq_id not in self._has_state:
                self.states.allocate(seg.seq.seq_id)
                self._has_state.add(seg.seq.seq_id)
        return self._forward(segments)

    # ------------------------------------------------------------ forward
    def _forward(self, segments: list[_Segment]) -> dict[int, torch.Tensor]:
        model, config = self.model, self.config
        hc = config.hc_mult
        _relayout(segments)
        pos = torch.cat([torch.arange(s.start, s.end) for s in segments]).to(self.device)
        ids = torch.cat(
            [torch.tensor(s.seq.token_ids[s.start : s.end], dtype=torch.long) for s in segments]
        ).to(self.device)
        R = model.embed(ids).unsqueeze(1).expand(-1, hc, -1).contiguous()
        pre = torch.zeros(R.shape[0], hc, dtype=torch.float32, device=self.device)
        pre[:, 0] = 1.0  # the first collapse takes copy 0 (ARCHITECTURE 1.3)
        topk: dict[int, torch.Tensor] = {}  # published selection of each index source
        candidates: torch.Tensor | None = None
        tables = _row_block_tables(segments, self.device)  # each row's block table
        # Engram reads each row's last n-gram of token ids; built once per step.
        token_ids = {
            s.seq.seq_id: torch.tensor(s.seq.token_ids[: s.end], device=self.device)
            for s in segments
        }

        for block in model.layers:
            l = block.layer_id
            attn = block.attn
            if block.engram is not None:
                rows = [
                    model.engram_rows(token_ids[s.seq.seq_id], s.start, s.end, l) for s in segments
                ]
                R = block.engram(R, torch.cat(rows))
            pre_a, post_a, comb_a = block.hc_attn(R)
            x = block.attn_norm(hc_collapse(R, pre))
            swa_k, swa_valid = self._swa_windows(l, segments, attn.project_kv(x, pos))
            if l in self.ratios:
                self._write_global_kv(block, segments, x)
            if l == self.boundary:
                keep = self._decoder_rows(segments)
                if keep is not None:
                    R, x, pos, pre = R[keep], x[keep], pos[keep], pre[keep]
                    tables = tables[keep]
                    pre_a, post_a, comb_a = pre_a[keep], post_a[keep], comb_a[keep]
                    swa_k, swa_valid = swa_k[keep], swa_valid[keep]
                if not segments:
                    return {}
            q, qr = attn.project_q(x, pos)
            o = self._attention(
                block, segments, q, qr, x, pos, tables, swa_k, swa_valid, topk, candidates
            )
            if isinstance(o, tuple):
                o, candidates = o
            R = hc_mix(R, attn.project_out(o, pos), post_a, comb_a)
            pre_f, post_f, comb_f = block.hc_ffn(R)
            x = block.ffn_norm(hc_collapse(R, pre_a))
            R = hc_mix(R, block.ffn(x), post_f, comb_f)
            pre = pre_f

        last = torch.tensor([s.offset + s.rows - 1 for s in segments if s.wants_logits])
        out: dict[int, torch.Tensor] = {}
        if last.numel():
            h = model.norm(hc_collapse(R[last], pre[last]))
            logits = upcast(model.head(h.to(model.head.weight.dtype)))
            for i, s in enumerate(s for s in segments if s.wants_logits):
                out[s.seq.seq_id] = logits[i]
        return out

    # ------------------------------------------------------------ pieces
    def _swa_start(self, layer: int, seq: Sequence) -> int:
        """First position this layer's SWA window may read (docs/design/semantics.md)."""
        return seq.encoder_start if layer <= self.boundary else seq.decoder_start

    def _swa_windows(
        self, layer: int, segments: list[_Segment], kv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the keys of its window [max(start, p - W + 1), p]: [T, W, d] and a mask.

        Keys are the MXFP8 round trip of each row's kv, as stored. Older rows come
        from the sequence's ring; the segment's own rows are written to the ring
        after the window is read, so a chunk longer than the ring still sees them.
        """
        W = self.window
        records = quantize_swa(kv)
        stored = dequantize_swa(records).to(kv.dtype)
        keys = kv.new_zeros(kv.shape[0], W, kv.shape[1])
        valid = torch.zeros(kv.shape[0], W, dtype=torch.bool, device=kv.device)
        singles = [s for s in segments if s.rows == 1]
        if singles:
            self._decode_windows(layer, singles, records, keys, valid)
        for seg in segments:
            if seg.rows == 1:
                continue
            ring = self.states.swa_window(layer, seg.seq.seq_id)
            start = self._swa_start(layer, seg.seq)
            first = max(start, seg.start - W + 1)
            old_pos = torch.arange(first, seg.start, device=kv.device)
            new = stored[seg.offset : seg.offset + seg.rows]
            buf = torch.cat([dequantize_swa(ring[old_pos % W]).to(kv.dtype), new])
            rows_pos = torch.arange(seg.start, seg.end, device=kv.device)
            key_pos = rows_pos[:, None] - W + 1 + torch.arange(W, device=kv.device)[None, :]
            ok = key_pos >= first
            idx = (key_pos - first).clamp(min=0)
            keys[seg.offset : seg.offset + seg.rows] = buf[idx]
            valid[seg.offset : seg.offset + seg.rows] = ok
            tail = min(seg.rows, W)
            ring[rows_pos[-tail:] % W] = records[
                seg.offset + seg.rows - tail : seg.offset + seg.rows
            ]
        return keys, valid

    def _decode_windows(
        self,
        layer: int,
        singles: list[_Segment],
        records: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """``_swa_windows`` for one-row segments (decode), batched over sequences.

        With one new row per sequence the ring can take it first and every window
        is then read from the rings in one gather.
        """
        W = self.window
        device = keys.device
        rings = self.states.swa[layer]  # [slots, W, record bytes]
        rows = torch.tensor([s.offset for s in singles], device=device)
        slots = torch.tensor([self.states.slot(s.seq.seq_id) for s in singles], device=device)
        pos = torch.tensor([s.start for s in singles], device=device)
        start = torch.tensor([self._swa_start(layer, s.seq) for s in singles], device=device)
        rings[slots, pos % W] = records[rows]
        key_pos = pos[:, None] - W + 1 + torch.arange(W, device=device)[None, :]
        window = rings[slots[:, None], key_pos % W]  # [n, W, record bytes]
        keys[rows] = dequantize_swa(window).to(keys.dtype)
        valid[rows] = key_pos >= start[:, None]

    def _write_global_kv(self, block, segments: list[_Segment], x: torch.Tensor) -> None:
        """Compress, quantise and store this source's entries that start at >= H.

        Every sequence's complete groups are gathered first, so the projections,
        the norm, the index keys and the store run once per step, not per sequence.
        """
        l = block.layer_id
        ratio = self.ratios[l]
        attn = block.attn
        pages = self.pages[l]
        per_page = pages.entries_per_page
        raw_all = attn.compressor.project(x)  # fp32 [T, row width]
        groups: list[torch.Tensor] = []  # complete-group rows, whole groups per sequence
        entries: list[torch.Tensor] = []
        page_ids: list[torch.Tensor] = []
        for seg in segments:
            seq = seg.seq
            lo = max(seg.start, seq.stored_tokens)
            if lo >= seg.end:
                continue
            raw = raw_all[seg.offset + lo - seg.start : seg.offset + seg.rows]
            first = lo
            if ratio > 1:
                state = self.states.compressor_state(self.pending_index[l], seq.seq_id)
                if lo % ratio:  # the open group began in an earlier step
                    first = lo - lo % ratio
                    raw = torch.cat([state[: lo % ratio], raw])
                open_rows = (seg.end - first) % ratio
                if open_rows:
                    state[:open_rows] = raw[raw.shape[0] - open_rows :]
                    raw = raw[: raw.shape[0] - open_rows]
            if raw.shape[0] == 0:
                continue
            ids = torch.arange(raw.shape[0] // ratio, device=x.device) + first // ratio
            table = torch.tensor(seq.block_table, dtype=torch.long, device=x.device)
            groups.append(raw)
            entries.append(ids)
            page_ids.append(table[ids // per_page])
        if not groups:
            return
        latent = attn.compressor.combine(torch.cat(groups)).to(x.dtype)
        entry_ids = torch.cat(entries)
        entry_pos = entry_ids * ratio  # RoPE at each group's first position
        store_kv_entries(
            pages.main_data,
            pages.main_scales,
            pages.index_data,
            pages.index_scales,
            torch.cat(page_ids),
            entry_ids % per_page,
            rope_tail(latent, entry_pos, attn.inv_freq),
            attn.indexer.keys(latent, entry_pos),
        )

    def _decoder_rows(self, segments: list[_Segment]) -> torch.Tensor | None:
        """Drop rows below each sequence's decoder start; None when every row stays."""
        keep: list[torch.Tensor] = []
        changed = False
        kept_segments: list[_Segment] = []
        for seg in segments:
            first = min(max(seg.start, seg.seq.decoder_start), seg.end)
            rows = torch.arange(seg.offset + first - seg.start, seg.offset + seg.rows)
            changed |= first != seg.start
            if rows.numel():
                keep.append(rows)
                kept_segments.append(_Segment(seg.seq, first, seg.end, seg.wants_logits))
        segments[:] = kept_segments
        _relayout(segments)
        if not changed:
            return None
        return torch.cat(keep) if keep else torch.zeros(0, dtype=torch.long)

    def _attention(
        self, block, segments, q, qr, x, pos, tables, swa_k, swa_valid, topk, candidates
    ):
        """Sparse attention of every row; returns o (and the candidates at the candidate source).

        All rows are scored and selected together: each row carries its own block
        table and its visibility follows from its position, so rows of different
        sequences never see each other's entries.
        """
        config = self.config
        l = block.layer_id
        attn = block.attn
        role = config.role(l)
        src = config.kv_source(l) if role is not LayerRole.SWA_ONLY else None
        pages = self.pages[src if src is not None else config.kv_source_layer_ids[0]]
        published = None
        if role is LayerRole.SWA_ONLY:
            idx = torch.zeros(q.shape[0], 0, dtype=torch.long, device=q.device)
        elif role is LayerRole.REUSE:
            idx = topk[config.index_source(l)]
        else:
            ratio = self.ratios[src]
            n_cols = max(s.end for s in segments) // ratio
            qi, w = attn.indexer.queries(qr, x, pos)
            n_visible = torch.div(pos + 1, ratio, rounding_mode="floor")
            scores = indexer_scores(
                qi, w, pages.index_data, pages.index_scales, tables, n_visible, n_cols
            )
            visible = visible_entries(pos, n_cols, ratio)
            allowed = visible
            if role is LayerRole.REINDEX and candidates is not None:
                allowed = visible & candidates
            if l == config.candidate_source_layer_id:
                published = candidate_block_mask(
                    scores, visible, config.candidate_block_size, config.candidate_topk_blocks
                )
            idx = topk[l] = select_topk(scores, allowed, config.index_topk)
        o = sparse_attention(
            q,
            swa_k,
            swa_valid,
            pages.main_data,
            pages.main_scales,
            tables,
            idx,
            attn.attn_sink,
            attn.softmax_scale,
        )
        return (o, published) if published is not None else o


def _relayout(segments: list[_Segment]) -> None:
    offset = 0
    for seg in segments:
        seg.offset = offset
        offset += seg.rows


def _row_block_tables(segments: list[_Segment], device: torch.device) -> torch.Tensor:
    """Each row's sequence block table, padded with page 0: [T, max_pages]."""
    width = max(1, max(len(s.seq.block_table) for s in segments))
    tables = torch.zeros(sum(s.rows for s in segments), width, dtype=torch.long)
    for seg in segments:
        table = torch.tensor(seg.seq.block_table, dtype=torch.long)
        tables[seg.offset : seg.offset + seg.rows, : table.numel()] = table
    return tables.to(device)
