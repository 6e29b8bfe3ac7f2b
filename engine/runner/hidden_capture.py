"""The layer inputs a drafter reads (``Proposer.hidden_layers``), caught as a step runs.

A pre-hook on each named block keeps the residual streams entering it, ``R [rows,
hc, hidden]``, with the rows' positions: at that point the backend's segments are
the rows this layer runs (the replay plan cut the rest before it). The engine
then keeps, per sequence, the rows it committed (engine/core/speculation.py).

A step on the decode CUDA graphs calls no block (a replay runs no hook): there
``DecodeGraphs.forward`` hands each layer's input to ``keep`` at the piece boundary
before that layer's attention, where the same ``R`` sits in the static slots
(docs/design/cuda-graphs.md, "Hidden capture").
"""

from __future__ import annotations

import torch

from engine.model.base import CausalLM
from engine.runner.paged_backend import PagedKV


class HiddenCapture:
    """Per step: seq_id -> layer -> (first position, ``R`` rows from it on)."""

    def __init__(self, model: CausalLM, layers: tuple[int, ...]) -> None:
        self.layers = layers
        self.rows: dict[int, dict[int, tuple[int, torch.Tensor]]] = {}
        self._handles = [model.block(l).register_forward_pre_hook(self._hook(l)) for l in layers]

    def _hook(self, layer: int):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            R, kv = args[0], args[3]
            if isinstance(kv, PagedKV):  # not another backend's forward (a reference run)
                self.keep(layer, R, kv)

        return hook

    def keep(self, layer: int, R: torch.Tensor, kv: PagedKV) -> None:
        """Keep ``R``, the input of ``layer`` for the rows of ``kv``'s segments, if a
        drafter reads that layer; copied (a graph step's ``R`` is a slot it overwrites)."""
        if layer not in self.layers:
            return
        for seg in kv.segments:
            rows = R[seg.offset : seg.offset + seg.rows].detach().clone()
            self.rows.setdefault(seg.seq.seq_id, {})[layer] = (seg.start, rows)

    def close(self) -> None:
        """Take the hooks off the model (another engine may run it next)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def take(self) -> dict[int, dict[int, tuple[int, torch.Tensor]]]:
        rows, self.rows = self.rows, {}
        return rows
