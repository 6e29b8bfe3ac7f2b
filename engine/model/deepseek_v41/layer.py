"""One transformer block of V4.1: Engram, attention and MoE around mHC residual streams."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.deepseek_v41.attention import Attention, Selections
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.engram import Engram
from engine.model.deepseek_v41.mhc import hc_coefficients, hc_collapse, hc_mix
from engine.model.deepseek_v41.moe import MoE
from engine.model.deepseek_v41.norm import RMSNorm
from engine.model.kv.kv_backend import KVBackend
from engine.model.parallel import SINGLE, Parallel


class Block(nn.Module):
    """Layer ``layer_id``: parameters under their official checkpoint names."""

    def __init__(self, config: ModelConfig, layer_id: int, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        dim, hc = config.hidden_size, config.hc_mult
        n_coef = (2 + hc) * hc
        self.attn_norm = RMSNorm(dim, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(dim, config.rms_norm_eps)
        self.attn = Attention(config, layer_id, parallel)
        self.ffn = MoE(config, parallel)
        self.engram = Engram(config, layer_id) if layer_id in config.engram_layer_ids else None
        # mHC coefficients are computed in fp32 (docs/design/architecture.md §1.3).
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

    def forward(
        self,
        R: torch.Tensor,
        pre: torch.Tensor,
        token_rows: torch.Tensor | None,
        kv: KVBackend,
        sel: Selections,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual streams ``R`` [T, hc, D] and the previous sublayer's ``pre`` [T, hc]
        -> the same for the rows the next layer needs.

        ``token_rows``: the Engram table rows of every row in flight (Engram
        layers only). The attention input collapses with the previous sublayer's
        ``pre``, the FFN input with the attention's; the FFN's is carried on.
        """
        if self.engram is not None:
            assert token_rows is not None
            live = None if sel.image_rows is None else ~sel.image_rows
            R = self.engram(R, token_rows, live)
        pre_a, post_a, comb_a = self.hc_attn(R)
        x = self.attn_norm(hc_collapse(R, pre))
        self.attn.store_kv(x, kv)
        keep = kv.keep_rows(self.layer_id)
        if keep is not None:  # the replay plan's cut: only these rows go on
            R, x, pre_a, post_a, comb_a = R[keep], x[keep], pre_a[keep], post_a[keep], comb_a[keep]
            sel.keep(keep)
        if R.shape[0] == 0:
            if self.ffn.parallel.ep_dispatch:  # the other EP ranks' rows need our experts
                self.ffn(x)
            return R, pre_a
        R = hc_mix(R, self.attn(x, kv, sel), post_a, comb_a)
        pre_f, post_f, comb_f = self.hc_ffn(R)
        x = self.ffn_norm(hc_collapse(R, pre_a))
        R = hc_mix(R, self.ffn(x, sel.image_rows), post_f, comb_f)
        return R, pre_f
