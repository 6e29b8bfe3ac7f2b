"""Training signal for the lightning indexer, whose top-k is not differentiable.

As in DeepSeek-V3.2's indexer training, each index source layer l gets a KL
loss pulling the softmax of its scores over the visible compressed entries
towards the main attention's distribution over those entries: the softmax of
q . k over all visible entries (not only the selected ones), summed over the
heads of every layer that reads l's top-k (l and the Reuse layers after it),
renormalised. Targets are computed without gradient and the indexer's inputs
are detached, so the loss trains only the indexer (``wq_b``, ``weights_proj``
and, on kv sources, ``wk`` / ``k_norm``) and the language-model loss only the
rest.
"""

from __future__ import annotations

import torch
from torch.utils.hooks import RemovableHandle

from engine.model.base import CausalLM
from engine.model.deepseek_v41.candidates import visible_entries
from engine.model.deepseek_v41.compressor import entry_positions
from engine.model.deepseek_v41.config import LayerRole
from engine.model.deepseek_v41.reference import GlobalKV


class AttentionInputs:
    """Captures each layer's attention input ``x = attn_norm(collapse(R))`` during a forward."""

    def __init__(self, model: CausalLM) -> None:
        self.x: dict[int, torch.Tensor] = {}
        self._handles: list[RemovableHandle] = [
            block.attn_norm.register_forward_hook(self._hook(block.layer_id))
            for block in model.blocks
        ]

    def _hook(self, layer: int):
        def store(module, args, output) -> None:
            self.x[layer] = output.detach()

        return store

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def readers(model: CausalLM, index_layer: int) -> list[int]:
    """Layers reading ``index_layer``'s top-k: itself and the Reuse layers after it."""
    config = model.config
    return [
        l
        for l in range(config.num_hidden_layers)
        if config.role(l) is not LayerRole.SWA_ONLY and config.index_source(l) == index_layer
    ]


def indexer_kl(model: CausalLM, x: dict[int, torch.Tensor], global_kv: GlobalKV) -> torch.Tensor:
    """Sum over index source layers of the mean per-query KL(attention || indexer).

    ``x`` holds every layer's attention input of an exact forward over
    positions 0..N-1; ``global_kv`` is that forward's global KV (RoPE'd
    latents). Queries that see no compressed entry are left out.
    """
    config = model.config
    total = torch.zeros(())
    for l in config.index_source_layer_ids:
        src = config.kv_source(l)
        assert src is not None
        ratio = config.compress_ratios[src]
        pos = torch.arange(x[l].shape[0])
        latents = global_kv.latents[src].detach()
        visible = visible_entries(pos, latents.shape[0], ratio)
        rows = visible.any(dim=-1)
        if not rows.any():
            continue
        with torch.no_grad():
            target = _attention_target(model, x, l, latents, pos, visible)
            _, qr = model.block(l).attn.project_q(x[l], pos)
            source = model.block(src).attn
            assert source.compressor is not None and source.indexer is not None
            latent = source.compressor(x[src])  # un-RoPE'd, as the index keys take it
        keys = source.indexer.keys(latent, entry_positions(latent.shape[0], ratio))
        indexer = model.block(l).attn.indexer
        assert indexer is not None, "an index source layer"
        qi, w = indexer.queries(qr, x[l], pos)
        scores = indexer.scores(qi, w, keys).masked_fill(~visible, float("-inf"))
        log_q = torch.log_softmax(scores[rows], dim=-1)
        p = target[rows]
        kl = torch.where(p > 0, p * (p.clamp_min(1e-30).log() - log_q), 0.0).sum(-1)
        total = total + kl.mean()
    return total


def _attention_target(
    model: CausalLM,
    x: dict[int, torch.Tensor],
    index_layer: int,
    latents: torch.Tensor,
    pos: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """[T, S]: the readers' attention over visible entries, summed over heads and layers,
    normalised."""
    target = torch.zeros(visible.shape)
    for m in readers(model, index_layer):
        attn = model.block(m).attn
        q, _ = attn.project_q(x[m], pos)
        logits = torch.einsum("thd,sd->ths", q.float(), latents.float()) * attn.softmax_scale
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        target += torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=1)
    return target / target.sum(dim=-1, keepdim=True).clamp_min(1e-30)
