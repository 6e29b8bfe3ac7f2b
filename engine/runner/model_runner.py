"""The production model runner: paged FP4 global KV, per-request SWA rings, one pass per step.

Every step runs the rows of all scheduled sequences together through the
model's one forward (``CausalLM.forward``) over the paged KV backend
(``engine/runner/paged_backend.py``), under each sequence's replay plan
(docs/design/semantics.md):

- a prefill chunk's rows go through each layer from the plan's start of that
  layer on (the encoder and layer B's KV writes on every row of a cold
  prefill, the decoder on the last W rows; a restore's triangle of replay);
- a decode row is a chunk of one row that runs every layer;
- a verify chunk (a decode row and its ``k`` drafts) is a chunk of ``k + 1`` rows
  that runs every layer and returns the logits of each; the rows the engine then
  drops are undone in the request state before the sequence runs again
  (engine/runner/verify_undo.py).

A decode-only step (plain decodes and verify chunks) replays the captured CUDA
graphs when its row count has a bucket (``cuda_graphs.py``); the eager attention
side between the pieces reads and undoes a verify chunk as the eager forward does.

The dense oracle is the same forward over ``engine/model/kv/dense_backend.py``;
the engine tests hold the two together.

Image rows (``image_rows.py``): each segment's image positions take their
span rows from the runner's encoder cache (``encoder_cache.py``), which runs
the vision tower once per image.

The runner owns the KV bytes of its process: the page pool it is given
(``DevicePool``; which page holds what is the ``KVManager``'s bookkeeping) and
the per-request SWA rings and compressor rows it allocates (``RequestStatePool``).
"""

from __future__ import annotations

from functools import partial

import torch

from engine.api.request import TokenLogprob
from engine.core.sequence import Sequence
from engine.core.step import StepBatch
from engine.model.base import CausalLM
from engine.runner.cuda_graphs import DecodeGraphs
from engine.runner.hidden_capture import HiddenCapture
from engine.runner.image_rows import encoder_cache_for, image_embeds
from engine.runner.paged_backend import PagedKV, Segment
from engine.runner.verify_undo import VerifyUndo
from engine.sample.prompt_scores import score_rows
from kvstore.device.device_pool import DevicePool
from kvstore.request_state import RequestStateLayout, RequestStatePool


class PagedModelRunner:
    """Implements ``engine.core.step.ModelRunner`` over a page pool and its own request state."""

    def __init__(
        self,
        model: CausalLM,
        device_pages: DevicePool,
        max_num_seqs: int,
        graphs: DecodeGraphs | None = None,
        *,
        encoder_cache_bytes: int = 256 << 20,
    ) -> None:
        self.model = model
        self.encoder_cache = encoder_cache_for(model, encoder_cache_bytes)
        # Captured decode steps (engine/runner/cuda_graphs.py); None: every step runs eagerly.
        self.graphs = graphs
        self.config = config = model.config
        self.device_pages = device_pages
        self.device = model.embed.weight.device
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
        self.pages = {l: device_pages.source(l) for l in config.kv_source_layer_ids}
        self._has_state: set[int] = set()
        # seq_id -> the state its last verify chunk overwrote, until it runs again.
        self._undo: dict[int, VerifyUndo] = {}
        self._prompt_scores: dict[int, list[TokenLogprob]] = {}
        self._hidden: HiddenCapture | None = None

    def capture_hidden(self, layers: tuple[int, ...]) -> None:
        """Keep the inputs of ``layers`` for a drafter (``take_hidden``): a hook on the
        eager forward, the piece boundaries on the decode graphs."""
        self._hidden = HiddenCapture(self.model, layers)

    def take_hidden(self) -> dict[int, dict[int, tuple[int, torch.Tensor]]]:
        """seq_id -> layer -> (first position, its input rows) of the last step."""
        return self._hidden.take() if self._hidden is not None else {}

    def close(self) -> None:
        if self._hidden is not None:
            self._hidden.close()

    def release(self, seq: Sequence) -> None:
        self._undo.pop(seq.seq_id, None)
        self.encoder_cache.release(seq.seq_id)
        if seq.seq_id in self._has_state:
            self._has_state.discard(seq.seq_id)
            self.states.free(seq.seq_id)

    @torch.no_grad()
    def execute(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        segments = [
            Segment(s, s.num_tokens - 1 - k, s.num_tokens, True, verify=k > 0)
            for s in batch.decodes
            for k in (batch.num_drafts(s),)
        ]
        segments += [
            Segment(c.seq, c.start, c.end, c.last and not c.seq.prefill_only)
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
            undo = self._undo.pop(seg.seq.seq_id, None)
            if undo is not None:  # drop what the rows the engine rejected left behind
                undo.rollback(self.states, seg.seq.seq_id, seg.seq.num_computed)
        kv = PagedKV(
            segments,
            self.pages,
            self.states,
            self.ratios,
            self.pending_index,
            self.config.sliding_window,
            self.device,
        )
        graphs, hidden = self.graphs, self._hidden
        if (
            graphs is not None
            and len(segments) == len(batch.decodes)
            and graphs.fits(kv.positions.shape[0])
            and (hidden is None or graphs.layer_inputs)
        ):
            # A decode-only step (verify chunks included) in a captured bucket: a decode
            # or draft row is never inside a span (a sampled placeholder takes its plain
            # embedding, as captured).
            logits = graphs.forward(kv, None if hidden is None else partial(hidden.keep, kv=kv))
        else:
            embeds = image_embeds(
                self.model, self.encoder_cache, [(s.seq, s.start, s.end) for s in segments]
            )
            logits = self.model(kv.input_ids(), kv, image_embeds=embeds)
        self._undo.update(kv.undo)
        out: dict[int, torch.Tensor] = {}
        for seg, first, count in kv.logit_segments():
            rows = logits[first : first + count]
            if seg.seq.scores_prompt:  # row p predicts token p + 1, up to the prompt's end
                seq = seg.seq
                targets = seq.token_ids[seg.start + 1 : min(seg.end + 1, seq.num_prompt_tokens)]
                assert seq.prompt_logprobs is not None
                scores = score_rows(rows, list(targets), seq.prompt_logprobs)
                self._prompt_scores.setdefault(seq.seq_id, []).extend(scores)
            if seg.verify:
                out[seg.seq.seq_id] = rows
            elif seg.wants_logits:
                out[seg.seq.seq_id] = rows[-1]
        return out

    def take_prompt_logprobs(self) -> dict[int, list[TokenLogprob]]:
        """Prompt-token scores computed since the last call, by sequence."""
        scores, self._prompt_scores = self._prompt_scores, {}
        return scores
