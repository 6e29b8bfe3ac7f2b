"""A float64 DSpark drafter written from the description (docs/design/dspark.md), plain
torch ops on the state dict's tensors by their checkpoint names: the tests' oracle,
sharing no code with engine/model/deepseek_v41/dspark/."""

from __future__ import annotations

import math

import torch

D64 = torch.float64


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float, sign: float = 1.0):
    """Interleaved-pair rotation of the last ``rope_dim`` dims by ``sign * pos * f_i``."""
    i = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    freq = (1.0 / theta**i).to(D64)  # the release's fp32 frequencies
    angle = sign * pos.to(torch.float32).to(D64)[:, None] * freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freq.shape[0],)
    c, s = angle.cos().view(shape), angle.sin().view(shape)
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    out = torch.empty_like(tail)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return torch.cat([head, out], -1)


def hc_coeffs(R, fn, base, scale, cfg):
    """pre [T, hc], post [T, hc], comb [T, hc, hc] (comb[i, j]: copy i into copy j)."""
    hc = cfg.hc_mult
    flat = R.reshape(R.shape[0], -1)
    m = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)) @ fn.T
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc)
    c = torch.softmax(logits, -1) + cfg.hc_eps
    c = c / (c.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(-2, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def attention(w, p, x, pos, ring, cfg):
    T, H, hd = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    eps, rd = cfg.rms_norm_eps, cfg.qk_rope_head_dim
    q = rms(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], eps) @ w[p + "wq_b.weight"].T
    q = rope(q.view(T, H, hd), pos, rd, cfg.rope_theta)
    kv = rope(rms(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], eps), pos, rd, cfg.rope_theta)
    keys = torch.cat([ring, kv])  # the ring, then the whole block: every query sees all
    logits = torch.einsum("thd,sd->ths", q, keys) / math.sqrt(hd)
    sink = w[p + "attn_sink"].view(1, H, 1).expand(T, H, 1)
    probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    o = rope(torch.einsum("ths,sd->thd", probs, keys), pos, rd, cfg.rope_theta, sign=-1.0)
    G = cfg.o_groups
    wo_a = w[p + "wo_a.weight"].view(G, cfg.o_lora_rank, -1)
    o = torch.einsum("tgi,goi->tgo", o.reshape(T, G, -1), wo_a)
    return o.reshape(T, -1) @ w[p + "wo_b.weight"].T


def swiglu(x, w1, w2, w3, limit):
    g, u = x @ w1.T, x @ w3.T
    if limit > 0:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return (torch.nn.functional.silu(g) * u) @ w2.T


def moe(w, p, x, cfg):
    scores = torch.sqrt(torch.nn.functional.softplus(x @ w[p + "gate.weight"].T))
    idx = torch.topk(scores + w[p + "gate.bias"], cfg.dspark_num_experts_per_tok, -1).indices
    wt = scores.gather(-1, idx)
    wt = wt / (wt.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
    lim = cfg.swiglu_limit
    y = swiglu(x, *(w[p + f"shared_experts.w{j}.weight"] for j in (1, 2, 3)), lim)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            ws = [w[p + f"experts.{e}.w{j}.weight"] for j in (1, 2, 3)]
            y[t] = y[t] + wt[t, k] * swiglu(x[t : t + 1], *ws, lim)[0]
    return y


def mix(R, y, post, comb):
    return torch.einsum("tij,tid->tjd", comb, R) + post[..., None] * y[:, None, :]


def stage(w, s, R, pre_prev, pos, ring, cfg):
    p, eps = f"mtp.{s}.", cfg.rms_norm_eps
    pa, qa, ca = hc_coeffs(
        R, w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"], cfg
    )
    x = rms((pre_prev[..., None] * R).sum(1), w[p + "attn_norm.weight"], eps)
    R = mix(R, attention(w, p + "attn.", x, pos, ring, cfg), qa, ca)
    pf, qf, cf = hc_coeffs(R, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"], cfg)
    x = rms((pa[..., None] * R).sum(1), w[p + "ffn_norm.weight"], eps)
    return mix(R, moe(w, p + "ffn.", x, cfg), qf, cf), pf


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(D64) for k, v in model.state_dict().items()}


def main_x(w, features: list[torch.Tensor], cfg) -> torch.Tensor:
    """features: each target layer's block input [rows, hc, D], in target-layer order."""
    h = torch.cat([f.to(D64).mean(1) for f in features], -1) @ w["mtp.0.main_proj.weight"].T
    return rms(h, w["mtp.0.main_norm.weight"], cfg.rms_norm_eps)


def ring_kv(w, s, mx, pos, cfg):
    p = f"mtp.{s}.attn."
    kv = rms(mx @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], cfg.rms_norm_eps)
    return rope(kv, pos, cfg.qk_rope_head_dim, cfg.rope_theta)


def draft(w, cfg, anchor: int, position: int, rings: list[torch.Tensor]):
    """(tokens [B], logits [B, V], confidence [B]) of the greedy block after ``anchor``."""
    B, hc, n = cfg.dspark_block_size, cfg.hc_mult, cfg.num_nextn_predict_layers
    ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (B - 1))
    pos = torch.arange(position, position + B)
    R = w["embed.weight"][ids][:, None, :].repeat(1, hc, 1)
    pre = torch.zeros(B, hc, dtype=D64)
    pre[:, 0] = 1
    for s in range(n):
        R, pre = stage(w, s, R, pre, pos, rings[s], cfg)
    h = (pre[..., None] * R).sum(1)
    last = f"mtp.{n - 1}."
    base = rms(h, w[last + "norm.weight"], cfg.rms_norm_eps) @ w["head.weight"].T
    prev, toks, rows, conf = anchor, [], [], []
    for j in range(B):
        code = w[last + "markov_head.embed.weight"][prev]
        row = base[j] + w[last + "markov_head.head.weight"] @ code
        feat = torch.cat([h[j], code])
        conf.append(torch.sigmoid(w[last + "confidence_head.proj.weight"][0] @ feat))
        prev = int(row.argmax())
        toks.append(prev)
        rows.append(row)
    return torch.tensor(toks), torch.stack(rows), torch.stack(conf)
