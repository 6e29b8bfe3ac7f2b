"""The ViT: patch embedding, pre-norm blocks with 2-D rotary attention, a final norm.

Checkpoint names under ``vision.``: ``patch_embed.proj.{weight,bias}``;
``blocks.N.{norm1,norm2}.weight``, ``blocks.N.attn.wqkv.{weight,bias}`` (q, k and
v stacked on the output dim), ``blocks.N.attn.wo.{weight,bias}``,
``blocks.N.mlp.w1.weight`` (gate and up stacked), ``blocks.N.mlp.w2.weight``;
``norm.weight``. Attention is bidirectional over the patches of one image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.deepseek_v41.vision.config import VISION_NORM_EPS, VisionConfig
from engine.model.precision import upcast


class VisionRMSNorm(nn.Module):
    """``weight * x * rsqrt(mean(x^2) + 1e-6)``, all in fp32, then the input's dtype.

    The weight stays fp32 whatever the tower's dtype (the ports keep it so), and
    multiplies before the cast: unlike the text model's norm, which casts first.
    """

    def __init__(self, dim: int, eps: float = VISION_NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = upcast(x)
        y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)
        return (upcast(self.weight) * y).to(x.dtype)


def rotary_angles(n_h: int, n_w: int, head_dim: int, theta: float) -> torch.Tensor:
    """[n_h * n_w, head_dim / 2] fp32 angles of the 2-D rotary embedding.

    Half the head's dims pair with the other half ("rotate half"); of the
    ``head_dim / 2`` pairs the first half turn with the patch's row, the second
    with its column, at frequencies ``theta^(-2i / (head_dim / 2))``.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    rows = torch.arange(n_h, dtype=torch.float32).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.float32).repeat(n_h)
    return torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary of ``x [N, heads, head_dim]``; ``cos/sin [N, 1, head_dim/2]``; fp32."""
    a, b = upcast(x).chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class VisionAttention(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = vision.num_attention_heads, vision.head_dim
        self.wqkv = nn.Linear(vision.hidden_size, 3 * vision.hidden_size, bias=True)
        self.wo = nn.Linear(vision.hidden_size, vision.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # [1, heads, N, head_dim]; no mask: every patch sees every patch of its image.
        # 4-D on purpose: torch's fused CPU kernel takes a batch dimension, while 3-D
        # inputs take the unfused path that holds all N x N scores (4.5 GB a block at
        # 1920x1080) and runs 3-4x slower.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)[0]
        return self.wo(o.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU: ``w2(silu(gate) * up)`` with ``[gate; up] = w1 x``."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(vision.hidden_size, 2 * vision.intermediate_size, bias=False)
        self.w2 = nn.Linear(vision.intermediate_size, vision.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.norm1 = VisionRMSNorm(vision.hidden_size)
        self.attn = VisionAttention(vision)
        self.norm2 = VisionRMSNorm(vision.hidden_size)
        self.mlp = VisionMLP(vision)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(vision.patch_dim, vision.hidden_size, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))


class VisionTransformer(nn.Module):
    """``vision.*``: patches [n_h * n_w, 3 p^2] of one image -> features [n_h * n_w, hidden]."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.vision = vision
        self.patch_embed = PatchEmbed(vision)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.num_hidden_layers))
        self.norm = VisionRMSNorm(vision.hidden_size)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        if patches.shape[0] != n_h * n_w:
            raise ValueError(f"a {n_h}x{n_w} grid has {n_h * n_w} patches, got {patches.shape[0]}")
        x = self.patch_embed(patches.to(self.patch_embed.proj.weight.dtype))
        angles = rotary_angles(n_h, n_w, self.vision.head_dim, self.vision.rope_theta)
        angles = angles.to(x.device).unsqueeze(1)
        cos, sin = angles.cos(), angles.sin()
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)
