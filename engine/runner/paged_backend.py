"""The paged KV backend: one engine step's rows over the KV store's pages and SWA rings.

Implements ``engine.model.kv.kv_backend.KVBackend`` for the rows of every sequence
scheduled in a step (prefill chunks and decode rows, ``segments``). Global KV
lives in the KV store's pages as FP4 records and MXFP4 index keys; SWA windows
live in the request-state rings as MXFP8 records; attention and the indexer run
through ``kernels/`` (PyTorch references on CPU, Triton on GPU). Each row carries
its sequence's block table, so rows of different sequences never see each
other's entries and every call is batched over the whole step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.sequence import Sequence
from engine.model.deepseek_v41.candidates import visible_entries
from engine.runner.verify_undo import VerifyUndo
from kernels.indexer_ops import indexer_scores, indexer_scores_at
from kernels.kv_cache_ops import store_kv_entries
from kernels.kv_formats import dequantize_swa, quantize_swa
from kernels.sparse_attention import sparse_attention
from kvstore.device.device_pool import SourcePages
from kvstore.request_state import RequestStatePool


@dataclass(slots=True)
class Segment:
    """Rows ``[start, end)`` of one sequence in flight, at ``offset`` in the row batch;
    ``verify``: a decode row and its drafts (logits of every row, undo of its state)."""

    seq: Sequence
    start: int
    end: int
    wants_logits: bool
    offset: int = 0
    verify: bool = False

    @property
    def rows(self) -> int:
        return self.end - self.start


def relayout(segments: list[Segment]) -> None:
    offset = 0
    for seg in segments:
        seg.offset = offset
        offset += seg.rows


class PagedKV:
    """``KVBackend`` of one step. Built by ``PagedModelRunner.execute``."""

    def __init__(
        self,
        segments: list[Segment],
        pages: dict[int, SourcePages],
        states: RequestStatePool,
        ratios: dict[int, int],
        pending_index: dict[int, int],
        window: int,
        device: torch.device,
    ) -> None:
        relayout(segments)
        self.segments = segments
        self.pages = pages
        self.states = states
        self.ratios = ratios
        self.pending_index = pending_index  # kv source -> compressor state slot
        self.window = window
        self.device = device
        self._pos = torch.cat([torch.arange(s.start, s.end) for s in segments]).to(device)
        self._tables = _row_block_tables(segments, device)
        # Engram reads each row's last n-gram of token ids; built once per step from
        # the tokens the step can reach (its rows and a short history before them),
        # not the whole context: ``(first position, ids)`` per sequence.
        self._token_ids = {
            s.seq.seq_id: _token_span(
                s.seq.token_ids, max(0, s.start - _TOKEN_HISTORY), s.end, device
            )
            for s in segments
        }
        self._swa: tuple[torch.Tensor, torch.Tensor] | None = None  # this layer's windows
        self._group_pages: torch.Tensor | None = None  # pages of the entries being stored
        self._may_cut = self._any_below(lambda s: s.seq.layer_starts[-1])
        # seq_id -> what this step's verify chunks overwrote (engine/runner/verify_undo.py).
        self.undo = {s.seq.seq_id: VerifyUndo(s.start, s.end) for s in segments if s.verify}

    def input_ids(self) -> torch.Tensor:
        return torch.cat([self._ids(s, s.start) for s in self.segments])

    def _ids(self, seg: Segment, lo: int) -> torch.Tensor:
        """Token ids at positions ``[lo, seg.end)`` of the segment's sequence."""
        first, ids = self._token_ids[seg.seq.seq_id]
        if lo < first:  # further back than the history kept: read the list
            return _token_span(seg.seq.token_ids, lo, seg.end, self.device)[1]
        return ids[lo - first : seg.end - first]

    # ------------------------------------------------------------ rows
    @property
    def positions(self) -> torch.Tensor:
        return self._pos

    def keep_rows(self, layer_id: int) -> torch.Tensor | None:
        """Cut each sequence's rows to those at or past its plan's start of layer l + 1."""
        if not self._may_cut or not self._any_below(lambda s: s.seq.layer_starts[layer_id + 1]):
            return None
        keep: list[torch.Tensor] = []
        kept: list[Segment] = []
        for seg in self.segments:
            first = min(max(seg.start, seg.seq.layer_starts[layer_id + 1]), seg.end)
            if first < seg.end:
                keep.append(torch.arange(seg.offset + first - seg.start, seg.offset + seg.rows))
                kept.append(Segment(seg.seq, first, seg.end, seg.wants_logits, verify=seg.verify))
        relayout(kept)
        self.segments = kept
        rows = (torch.cat(keep) if keep else torch.zeros(0, dtype=torch.long)).to(self.device)
        self._pos, self._tables = self._pos[rows], self._tables[rows]
        if self._swa is not None:
            self._swa = (self._swa[0][rows], self._swa[1][rows])
        self._may_cut = self._any_below(lambda s: s.seq.layer_starts[-1])
        return rows

    def _any_below(self, start_of) -> bool:
        return any(seg.start < start_of(seg) for seg in self.segments)

    def token_windows(self, n: int) -> torch.Tensor:
        out = []
        for seg in self.segments:
            lo = seg.start - (n - 1)
            window = self._ids(seg, max(0, lo))
            if lo < 0:
                window = torch.cat([window.new_full((-lo,), -1), window])
            out.append(window.unfold(0, n, 1))
        return torch.cat(out)

    def logit_rows(self) -> torch.Tensor | None:
        """The last row of each segment that wants logits, and every row of a prefill
        chunk that scores its prompt or of a verify chunk (see ``logit_segments``)."""
        rows: list[int] = []
        for s in self.segments:
            if s.seq.scores_prompt or s.verify:
                rows.extend(range(s.offset, s.offset + s.rows))
            elif s.wants_logits:
                rows.append(s.offset + s.rows - 1)
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def logit_segments(self) -> list[tuple[Segment, int, int]]:
        """(segment, first, count) of ``logit_rows``' output, segment by segment."""
        out, first = [], 0
        for s in self.segments:
            count = s.rows if s.seq.scores_prompt or s.verify else int(s.wants_logits)
            if count:
                out.append((s, first, count))
                first += count
        return out

    # ------------------------------------------------------------ SWA
    def store_swa(self, layer_id: int, kv: torch.Tensor) -> None:
        """Each row's window [max(start, p - W + 1), p] as [T, W, d] keys and a mask.

        Keys are the MXFP8 round trip of each row's kv, as stored. Older rows come
        from the sequence's ring; the segment's own rows are written to the ring
        after the window is read, so a chunk longer than the ring still sees them.
        """
        W = self.window
        records = quantize_swa(kv)
        keys = kv.new_zeros(kv.shape[0], W, kv.shape[1])
        valid = torch.zeros(kv.shape[0], W, dtype=torch.bool, device=kv.device)
        singles = [s for s in self.segments if s.rows == 1]
        if singles:
            self._decode_windows(layer_id, singles, records, keys, valid)
        stored = None  # the round trip of this step's rows: only chunks read it
        for seg in self.segments:
            if seg.rows == 1:
                continue
            if stored is None:
                stored = dequantize_swa(records).to(kv.dtype)
            ring = self.states.swa_window(layer_id, seg.seq.seq_id)
            start = seg.seq.layer_starts[layer_id]
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
            undo = self.undo.get(seg.seq.seq_id)
            if undo is not None:  # a verify chunk: W > k, so each row has a slot of its own
                undo.swa[layer_id] = ring[rows_pos % W].clone()
            ring[rows_pos[-tail:] % W] = records[
                seg.offset + seg.rows - tail : seg.offset + seg.rows
            ]
        self._swa = (keys, valid)

    def _decode_windows(
        self,
        layer_id: int,
        singles: list[Segment],
        records: torch.Tensor,
        keys: torch.Tensor,
        valid: torch.Tensor,
    ) -> None:
        """``store_swa`` for one-row segments (decode), batched over sequences.

        With one new row per sequence the ring can take it first and every window
        is then read from the rings in one gather.
        """
        W = self.window
        device = keys.device
        rings = self.states.swa[layer_id]  # [slots, W, record bytes]
        flat = rings.view(-1, rings.shape[-1])  # ring slot s, position p: row s * W + p
        all_rows = len(singles) == keys.shape[0]  # a decode-only step: rows in order
        rows = torch.tensor([s.offset for s in singles], device=device)
        slots = torch.tensor([self.states.slot(s.seq.seq_id) for s in singles], device=device)
        pos = torch.tensor([s.start for s in singles], device=device)
        start = torch.tensor([s.seq.layer_starts[layer_id] for s in singles], device=device)
        # Whole-record row copies through the flat ring (index_copy_ / index_select)
        # rather than two-index advanced indexing: the same bytes, fewer passes.
        flat.index_copy_(0, slots * W + pos % W, records if all_rows else records[rows])
        key_pos = pos[:, None] - W + 1 + torch.arange(W, device=device)[None, :]
        at = (slots[:, None] * W + key_pos % W).reshape(-1)
        window = flat.index_select(0, at).view(len(singles), W, -1)  # [n, W, record bytes]
        if all_rows:
            keys.copy_(dequantize_swa(window))
            valid.copy_(key_pos >= start[:, None])
            return
        keys[rows] = dequantize_swa(window).to(keys.dtype)
        valid[rows] = key_pos >= start[:, None]

    # ------------------------------------------------------------ global KV
    def compressor_groups(
        self, layer_id: int, raw: torch.Tensor, ratio: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's complete groups at or past its stored prefix, gathered so the
        combine, the index keys and the store run once per step, not per sequence."""
        per_page = self.pages[layer_id].entries_per_page
        groups: list[torch.Tensor] = []
        entries: list[torch.Tensor] = []
        page_ids: list[torch.Tensor] = []
        for seg in self.segments:
            seq = seg.seq
            lo = max(seg.start, seq.stored_tokens)
            if lo >= seg.end:
                continue
            rows = raw[seg.offset + lo - seg.start : seg.offset + seg.rows]
            first = lo
            if ratio > 1:
                state = self.states.compressor_state(self.pending_index[layer_id], seq.seq_id)
                if lo % ratio:  # the open group began in an earlier step
                    first = lo - lo % ratio
                    rows = torch.cat([state[: lo % ratio], rows])
                undo = self.undo.get(seq.seq_id)
                if undo is not None:
                    undo.groups[self.pending_index[layer_id]] = (ratio, first, rows.clone())
                open_rows = (seg.end - first) % ratio
                if open_rows:
                    state[:open_rows] = rows[rows.shape[0] - open_rows :]
                    rows = rows[: rows.shape[0] - open_rows]
            if rows.shape[0] == 0:
                continue
            ids = torch.arange(rows.shape[0] // ratio, device=raw.device) + first // ratio
            table = torch.tensor(seq.block_table, dtype=torch.long, device=raw.device)
            groups.append(rows)
            entries.append(ids)
            page_ids.append(table[ids // per_page])
        if not groups:
            return raw[:0], torch.zeros(0, dtype=torch.long, device=raw.device)
        self._group_pages = torch.cat(page_ids)
        return torch.cat(groups), torch.cat(entries)

    def store_global(
        self, layer_id: int, entry_ids: torch.Tensor, latent: torch.Tensor, index_key: torch.Tensor
    ) -> None:
        pages = self.pages[layer_id]
        assert self._group_pages is not None, "compressor_groups runs first"
        store_kv_entries(
            pages.main_data,
            pages.main_scales,
            pages.index_data,
            pages.index_scales,
            self._group_pages,
            entry_ids % pages.entries_per_page,
            latent,
            index_key,
        )
        self._group_pages = None

    # ------------------------------------------------------------ attention
    def index_scores(
        self, source_id: int, qi: torch.Tensor, weights: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ratio = self.ratios[source_id]
        pages = self.pages[source_id]
        n_cols = max(s.end for s in self.segments) // ratio
        n_visible = torch.div(self._pos + 1, ratio, rounding_mode="floor")
        # The kernels take the score scale folded into the head weights.
        scores = indexer_scores(
            qi,
            weights * scale,
            pages.index_data,
            pages.index_scales,
            self._tables,
            n_visible,
            n_cols,
        )
        return scores, visible_entries(self._pos, n_cols, ratio)

    def index_scores_at(
        self,
        source_id: int,
        qi: torch.Tensor,
        weights: torch.Tensor,
        scale: float,
        entries: torch.Tensor,
    ) -> torch.Tensor:
        pages = self.pages[source_id]
        return indexer_scores_at(
            qi, weights * scale, pages.index_data, pages.index_scales, self._tables, entries
        )

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        source_id: int | None,
        selection: torch.Tensor | None,
        sink: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        assert self._swa is not None, "store_swa runs first"
        swa_k, swa_valid = self._swa
        pages = self.pages[source_id if source_id is not None else next(iter(self.pages))]
        if selection is None:
            selection = torch.zeros(q.shape[0], 0, dtype=torch.long, device=q.device)
        return sparse_attention(
            q,
            swa_k,
            swa_valid,
            pages.main_data,
            pages.main_scales,
            self._tables,
            selection,
            sink,
            scale,
        )


# Token positions kept before each segment's first row (Engram's n-grams reach n - 1 back).
_TOKEN_HISTORY = 16


def _token_span(
    token_ids: list[int], lo: int, hi: int, device: torch.device
) -> tuple[int, torch.Tensor]:
    return lo, torch.tensor(token_ids[lo:hi], dtype=torch.long, device=device)


def _row_block_tables(segments: list[Segment], device: torch.device) -> torch.Tensor:
    """Each row's sequence block table, padded with page 0: [T, max_pages]."""
    width = max(1, max(len(s.seq.block_table) for s in segments))
    tables = torch.zeros(sum(s.rows for s in segments), width, dtype=torch.long)
    for seg in segments:
        table = torch.tensor(seg.seq.block_table, dtype=torch.long)
        tables[seg.offset : seg.offset + seg.rows, : table.numel()] = table
    return tables.to(device)
