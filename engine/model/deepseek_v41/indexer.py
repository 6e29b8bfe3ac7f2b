"""Lightning indexer of V4.1 (docs/design/architecture.md §1.7).

Index sources own ``wq_b`` and ``weights_proj`` (the query side); kv sources
also own ``wk`` and ``k_norm``, which turn the compressor's un-RoPE'd latent
into the index keys every later layer of the same source scores against.
Unlike V4, there is no indexer-local compressor over the hidden states.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.fp8_linear import linear32
from engine.model.deepseek_v41.norm import RMSNorm
from engine.model.deepseek_v41.rope import rope_inv_freq, rope_tail
from engine.model.precision import upcast
from kernels.kv_formats import fake_quant_index_key


def indexer_scores(
    qi: torch.Tensor, w: torch.Tensor, k: torch.Tensor, scale: float = 1.0
) -> torch.Tensor:
    """``I[t, s] = sum_h w[t, h] * (relu(qi[t, h] . k[s]) * scale)`` in fp32.

    qi [T, h, d], w [T, h], k [S, d] -> [T, S]. Visibility is the caller's job.
    The scale multiplies each head's relu before its weight, in the release's order.
    """
    dots = torch.einsum("thd,sd->ths", upcast(qi), upcast(k))
    return (dots.relu() * scale * upcast(w)[:, :, None]).sum(dim=1)


class Indexer(nn.Module):
    """``attn.indexer`` of an index source layer."""

    inv_freq: torch.Tensor  # a buffer
    wk: nn.Linear | None
    k_norm: RMSNorm | None

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        if layer_id not in config.index_source_layer_ids:
            raise ValueError(f"layer {layer_id} is not an index source")
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        if layer_id in config.kv_source_layer_ids:
            # V4.1 derives keys from the main 512-d latent; k_norm is an RMSNorm
            # (V3.2's indexer used a LayerNorm with bias).
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.wk = None
            self.k_norm = None
        # Same (YaRN) frequencies as the layer's attention: q.k stays relative.
        self.register_buffer("inv_freq", rope_inv_freq(config, layer_id), persistent=False)
        # Scores are relu(q.k) * head_dim^-0.5, weighted by w * n_heads^-0.5.
        self.score_scale = self.head_dim**-0.5
        self.weight_scale = self.n_heads**-0.5

    def keys(self, latent: torch.Tensor, entry_positions: torch.Tensor) -> torch.Tensor:
        """Index keys [S, index_head_dim] of un-RoPE'd latents [S, head_dim].

        RoPE on the last ``qk_rope_head_dim`` dims at each entry's group start.
        """
        assert self.wk is not None and self.k_norm is not None, "only kv sources own wk/k_norm"
        k = self.k_norm(F.linear(upcast(latent), upcast(self.wk.weight)).to(latent.dtype))
        return rope_tail(k, entry_positions, self.inv_freq)

    def queries(
        self, qr: torch.Tensor, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(qi [T, h, index_head_dim], head weights w [T, h] fp32).

        ``qi`` is RoPE'd at ``positions`` and MXFP4-rounded.

        ``qr`` is the attention's normed query latent, ``x`` the attention input.
        ``w`` folds in ``index_n_heads^-0.5``; ``score_scale`` (``index_head_dim^-0.5``)
        multiplies each head's relu.
        """
        # Projection outputs round to the model dtype, as the release's bf16 linears do.
        qi = linear32(qr, self.wq_b).to(qr.dtype)  # packed (Fp8Linear) or not
        qi = rope_tail(qi.view(-1, self.n_heads, self.head_dim), positions, self.inv_freq)
        # The release quantises the query like the keys (MXFP4, one power-of-two
        # scale per 32) before scoring: the trained top-k is that of quantised scores.
        # Training passes the gradient straight through the rounding.
        quantised = fake_quant_index_key(qi)
        qi = qi + (quantised - qi).detach() if qi.requires_grad else quantised
        w = upcast(F.linear(upcast(x), upcast(self.weights_proj.weight)).to(x.dtype))
        w = w * self.weight_scale
        return qi, w

    def scores(self, qi: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Dense scores [T, S] against keys k [S, index_head_dim]; see ``indexer_scores``."""
        return indexer_scores(qi, w, k, self.score_scale)
