"""A ModelRunner built on the dense oracle, over real KV pages.

For each sequence that needs logits, ``reference.forward`` runs over all its
tokens under the sequence's admission plan. Global KV below ``stored_tokens``
is read from the sequence's pages (dequantised from their bytes); entries the
pass completes for the first time are quantised into its pages. So prefix
hits, preemption resumes and SSD restores after a restart all go through the
same bytes the paged runner uses. Non-final prefill chunks do nothing: the
last chunk recomputes everything. A verify step (a decode with ``k`` drafts)
is the same forward over the drafts too, keeping the logits of its last
``k + 1`` rows; entries its dropped rows completed are written again from
``num_computed`` on the next step (pages past it are never committed). Slow
and obviously correct: the engine tests' oracle path and ``--runner reference``.
"""

from __future__ import annotations

import torch

from engine.api.request import TokenLogprob
from engine.core.sequence import Sequence
from engine.core.step import StepBatch
from engine.model.base import CausalLM
from engine.model.deepseek_v41.reference import forward
from engine.model.kv.dense_backend import GlobalKV, KVPrecision
from engine.model.semantics.replay import ReplayPlan
from engine.runner.image_rows import encoder_cache_for, image_embeds
from engine.sample.prompt_scores import score_rows
from kernels.kv_formats import (
    dequantize_index_key,
    dequantize_main_kv,
    quantize_index_key,
    quantize_main_kv,
)
from kernels.quant import (
    e2m1_decode,
    e2m1_encode,
    e4m3_round,
    e4m3_to_bytes,
    pack_nibbles,
    unpack_nibbles,
)
from kvstore.device.device_pool import DevicePool, SourcePages


class ReferenceRunner:
    """Dense recompute per step; global KV kept as bytes in the pool's pages."""

    def __init__(
        self,
        model: CausalLM,
        device_pages: DevicePool,
        precision: KVPrecision,
        *,
        encoder_cache_bytes: int = 256 << 20,
    ) -> None:
        assert precision.global_kv in ("fp4", "bf16"), "pages store fp4 or bf16 global KV"
        self.model = model
        # Every step recomputes the rows from the plan's encoder start: the image
        # rows among them come from here, the vision tower run once per image.
        self.encoder_cache = encoder_cache_for(model, encoder_cache_bytes)
        self.device_pages = device_pages
        self.precision = precision
        self.page_tokens = device_pages.layout.page_tokens
        self.sources = {s.layer_id: s.compress_ratio for s in device_pages.layout.sources}
        # seq_id -> tokens whose complete groups are in the pages (this admission).
        self._written: dict[int, int] = {}
        self._prompt_scores: dict[int, list[TokenLogprob]] = {}

    def execute(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        for seq in batch.decodes:
            # Rows past num_computed that an earlier verify step wrote were dropped.
            if seq.seq_id in self._written:
                self._written[seq.seq_id] = min(self._written[seq.seq_id], seq.num_computed)
            logits = self._run(seq, seq.num_tokens, 1 + batch.num_drafts(seq))
            assert logits is not None, "a decode row runs every layer"
            out[seq.seq_id] = logits if batch.num_drafts(seq) else logits[0]
        for chunk in batch.prefills:
            seq = chunk.seq
            if not chunk.last or chunk.end <= seq.stored_tokens:
                continue  # earlier chunks only mark progress; a full hit has nothing to run
            logits = self._run(seq, chunk.end)
            if logits is not None and not seq.prefill_only:
                out[seq.seq_id] = logits[0]
        return out

    def release(self, seq: Sequence) -> None:
        self._written.pop(seq.seq_id, None)
        self.encoder_cache.release(seq.seq_id)

    # ------------------------------------------------------------ internals
    def _run(self, seq: Sequence, n: int, rows: int = 1) -> torch.Tensor | None:
        """Logits ``[rows, vocab]`` of rows ``[n - rows, n)`` under ``seq``'s plan (None
        for a prefill-only plan, which runs no row past layer B); new global KV into
        its pages."""
        H = seq.stored_tokens
        plan = ReplayPlan(H, seq.layer_starts)
        stored = self._read(seq, H) if H else None
        device = self.model.embed.weight.device
        ids = torch.tensor(seq.token_ids[:n], device=device)
        embeds = image_embeds(self.model, self.encoder_cache, [(seq, plan.encoder_start, n)])
        result = forward(self.model, ids, plan, stored, self.precision, image_embeds=embeds)
        done = self._written.get(seq.seq_id, H)
        for layer, ratio in self.sources.items():
            first, last = done // ratio, n // ratio
            if last > first:
                self._write(seq, layer, first, result.global_kv, last)
        self._written[seq.seq_id] = n
        if seq.scores_prompt:  # an every-row plan: row p predicts token p + 1
            assert seq.prompt_logprobs is not None
            targets = list(seq.token_ids[1 : seq.num_prompt_tokens])
            self._prompt_scores[seq.seq_id] = score_rows(
                result.logits, targets, seq.prompt_logprobs
            )
        return result.logits[-rows:].float() if result.logits.shape[0] else None

    def take_prompt_logprobs(self) -> dict[int, list[TokenLogprob]]:
        """Prompt-token scores computed since the last call, by sequence."""
        scores, self._prompt_scores = self._prompt_scores, {}
        return scores

    def _slots(self, seq: Sequence, pages: SourcePages, first: int, last: int):
        entries = torch.arange(first, last)
        per_page = pages.entries_per_page
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[entries // per_page].to(pages.main.device), (entries % per_page).to(
            pages.main.device
        )

    def _read(self, seq: Sequence, tokens: int) -> GlobalKV:
        """Stored global KV of tokens ``[0, tokens)``, dequantised in the model's dtype."""
        dtype = self.model.embed.weight.dtype
        stored = GlobalKV()
        for layer, ratio in self.sources.items():
            pages = self.device_pages.source(layer)
            page, slot = self._slots(seq, pages, 0, tokens // ratio)
            main = torch.cat([pages.main_data[page, slot], pages.main_scales[page, slot]], -1)
            index = torch.cat([pages.index_data[page, slot], pages.index_scales[page, slot]], -1)
            stored.latents[layer] = self._decode(main, dequantize_main_kv).to(dtype)
            stored.keys[layer] = self._decode(index, dequantize_index_key).to(dtype)
        return stored

    def _write(self, seq: Sequence, layer: int, first: int, kv: GlobalKV, last: int) -> None:
        """Entries ``[first, last)`` of ``layer`` as records into ``seq``'s pages."""
        pages = self.device_pages.source(layer)
        page, slot = self._slots(seq, pages, first, last)
        main = self._encode(kv.latents[layer][first:last], quantize_main_kv)
        index = self._encode(kv.keys[layer][first:last], quantize_index_key)
        main_data = pages.main_data.shape[-1]
        index_data = pages.index_data.shape[-1]
        pages.main_data[page, slot] = main[:, :main_data]
        pages.main_scales[page, slot] = main[:, main_data:]
        pages.index_data[page, slot] = index[:, :index_data]
        pages.index_scales[page, slot] = index[:, index_data:]

    def _encode(self, values: torch.Tensor, quantize) -> torch.Tensor:
        """Records that decode to exactly the values the reference used.

        The reference hands us values already through the quantiser's round
        trip. MXFP4 index keys survive a second trip unchanged (a smaller
        power-of-two scale just doubles the codes); FP4 main records may not
        (a subnormal E4M3 tile scale can land the tile's largest code on 4),
        so those go through ``requantize_main_kv``.
        """
        if self.precision.global_kv == "bf16":
            return values.to(torch.bfloat16).contiguous().view(torch.uint8)
        if quantize is quantize_main_kv:
            return requantize_main_kv(values)
        return quantize(values)

    def _decode(self, records: torch.Tensor, dequantize) -> torch.Tensor:
        if self.precision.global_kv == "fp4":
            return dequantize(records)
        return records.contiguous().view(torch.bfloat16).float()


_E2M1_MAGNITUDES = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)


def requantize_main_kv(values: torch.Tensor) -> torch.Tensor:
    """288-byte records decoding to exactly ``values`` [N, 512], which lie on the FP4 grid.

    ``quantize_main_kv`` does that for most tiles. For the others, the tile's
    original scale is ``amax / c`` for ``c`` its largest code's magnitude: try
    each magnitude and keep a scale that E4M3 represents and that puts every
    value on a code.
    """
    rec = quantize_main_kv(values)
    tiles = values.float().reshape(-1, 32, 16)
    bad = (dequantize_main_kv(rec).reshape(-1, 32, 16) != tiles).any(-1)
    if not bool(bad.any()):
        return rec
    codes = unpack_nibbles(rec[:, :256]).reshape(-1, 32, 16)
    scales = rec[:, 256:].clone()
    amax = tiles.abs().amax(-1)
    for c in _E2M1_MAGNITUDES:
        scale = amax / c
        fits = bad & (scale > 0) & (e4m3_round(scale) == scale)
        trial = e2m1_encode(tiles / torch.where(fits, scale, 1.0)[..., None])
        fits &= (e2m1_decode(trial) * scale[..., None] == tiles).all(-1)
        codes = torch.where(fits[..., None], trial, codes)
        scales = torch.where(fits, e4m3_to_bytes(scale), scales)
        bad &= ~fits
    assert not bool(bad.any()), "values are not on the FP4 main-KV grid"
    return torch.cat([pack_nibbles(codes.reshape(-1, 512)), scales], dim=1)
