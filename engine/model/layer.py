"""One transformer block of V4.1: Engram, attention and MoE around mHC residual streams."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.attention import Attention
from engine.model.config import ModelConfig
from engine.model.engram import Engram
from engine.model.mhc import hc_coefficients
from engine.model.moe import MoE
from engine.model.norm import RMSNorm


class Block(nn.Module):
    """Layer ``layer_id``: parameters under their official checkpoint names.

    The forward logic lives in ``reference.py`` (dense) and the engine's model
    runner (paged); both call the same sub-modules so they cannot drift apart.
    """

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        dim, hc = config.hidden_size, config.hc_mult
        n_coef = (2 + hc) * hc
        self.attn_norm = RMSNorm(dim, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(dim, config.rms_norm_eps)
        self.attn = Attention(config, layer_id)
        self.ffn = MoE(config)
        self.engram = Engram(config, layer_id) if layer_id in config.engram_layer_ids else None
        # mHC coefficients are computed in fp32 (ARCHITECTURE 1.3).
        self.hc_attn_fn = nn.Parameter(torch.empty(n_coef, hc * dim, dtype=torch.float32))
        self.hc_attn_base = nn.Parameter(torch.empty(n_coef, dtype=torch.float32))
        self.hc_attn_scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.hc_ffn_fn = nn.Parameter(torch.empty(n_coef, hc * dim, dtype=torch.float32))
        self.hc_ffn_base = nn.Parameter(torch.empty(n_coef, dtype=torch.float32))
        self.hc_ffn_scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self._hc_eps = config.hc_eps
        self._sinkhorn_iters = config.hc_sinkhorn_iters
        self._norm_eps = config.rms_norm_eps

    def hc_attn(self, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre, post, comb) of the attention sublayer for residual streams R [T, hc, D]."""
        return hc_coefficients(
            R,
            self.hc_attn_fn,
            self.hc_attn_base,
            self.hc_attn_scale,
            hc_eps=self._hc_eps,
            sinkhorn_iters=self._sinkhorn_iters,
            norm_eps=self._norm_eps,
        )

    def hc_ffn(self, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return hc_coefficients(
            R,
            self.hc_ffn_fn,
            self.hc_ffn_base,
            self.hc_ffn_scale,
            hc_eps=self._hc_eps,
            sinkhorn_iters=self._sinkhorn_iters,
            norm_eps=self._norm_eps,
        )
