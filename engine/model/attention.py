"""Attention projections of a V4.1 layer (ARCHITECTURE 1.4).

The module owns the weights and the per-token projections; which keys a query
sees (SWA window, compressed top-k) is decided by the caller (the dense
reference or the engine), which then runs ``sink_attention`` or a kernel held
to it. Attribute names are the checkpoint's: ``layers.L.attn.<name>``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.compressor import Compressor
from engine.model.config import ModelConfig
from engine.model.indexer import Indexer
from engine.model.norm import RMSNorm
from engine.model.precision import upcast
from engine.model.rope import rope_inv_freq, rope_tail


def _linear32(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return F.linear(upcast(x), upcast(layer.weight))


class GroupedLinear(nn.Module):
    """Block-diagonal projection: group g maps its own input slice to ``out_per_group``.

    ``weight`` is ``[n_groups * out_per_group, in_per_group]``, the checkpoint's
    ``wo_a.weight``: rows ``g * out_per_group ..`` belong to group g (the layout
    vLLM's ``wo_a.weight.view(G, o_lora_rank, -1)`` and transformers'
    ``DeepseekV4GroupedLinear`` read).
    """

    def __init__(self, in_per_group: int, out_per_group: int, n_groups: int) -> None:
        super().__init__()
        self.n_groups = n_groups
        self.out_per_group = out_per_group
        self.weight = nn.Parameter(torch.empty(n_groups * out_per_group, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n_groups, in_per_group] -> [..., n_groups, out_per_group], fp32."""
        w = upcast(self.weight).view(self.n_groups, self.out_per_group, -1)
        return torch.einsum("...gi,goi->...go", upcast(x), w)


class Attention(nn.Module):
    """``layers.L.attn``: MQA over one 512-d latent with K = V, a sink per head."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        dim, heads, head_dim = config.hidden_size, config.num_attention_heads, config.head_dim
        self.n_heads = heads
        self.head_dim = head_dim
        self.o_groups = config.o_groups
        eps = config.rms_norm_eps
        self.wq_a = nn.Linear(dim, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, eps)
        self.wq_b = nn.Linear(config.q_lora_rank, heads * head_dim, bias=False)
        self.wkv = nn.Linear(dim, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps)
        self.wo_a = GroupedLinear(
            heads // config.o_groups * head_dim, config.o_lora_rank, config.o_groups
        )
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, dim, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(heads, dtype=torch.float32))
        self.compressor = (
            Compressor(config, layer_id) if layer_id in config.kv_source_layer_ids else None
        )
        self.indexer = (
            Indexer(config, layer_id) if layer_id in config.index_source_layer_ids else None
        )
        self.register_buffer("inv_freq", rope_inv_freq(config, layer_id), persistent=False)
        self.softmax_scale = head_dim**-0.5

    def project_q(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, head_dim] RoPE'd at ``positions``, qr = q_norm(wq_a x) [T, q_lora_rank]).

        V4.1 has no per-head q norm (V4 had an unweighted one).
        """
        qr = self.q_norm(_linear32(x, self.wq_a))
        q = _linear32(qr, self.wq_b).view(-1, self.n_heads, self.head_dim)
        q = rope_tail(q, positions, self.inv_freq)
        return q.to(x.dtype), qr.to(x.dtype)

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This token's SWA key/value: kv_norm(wkv x) RoPE'd at ``positions``, [T, head_dim]."""
        kv = self.kv_norm(_linear32(x, self.wkv))
        return rope_tail(kv, positions, self.inv_freq).to(x.dtype)

    def project_out(self, o: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Attention output o [T, H, head_dim] -> [T, D].

        V = K carries RoPE, so the tail is rotated back by -pos first; then
        heads ``g*H/G .. (g+1)*H/G - 1`` go through ``wo_a`` group g, and
        ``wo_b`` mixes the groups.
        """
        dtype = o.dtype
        o = rope_tail(upcast(o), positions, self.inv_freq, inverse=True)
        grouped = self.wo_a(o.reshape(o.shape[0], self.o_groups, -1))
        return _linear32(grouped.flatten(1), self.wo_b).to(dtype)
