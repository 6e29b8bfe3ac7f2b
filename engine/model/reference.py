"""Dense reference forward: the oracle for every engine test.

Whole sequence, no cache, every attention as a masked dense softmax. One
function, ``forward``, implements all four semantics of ARCHITECTURE 2.1 through
a ``ReplayPlan`` (docs/design/semantics.md):

- exact (training forward):           ReplayPlan.exact()
- CED prefill with bounded replay:    ReplayPlan.prefill(L, W)
- restore after a prefix hit of H:    ReplayPlan.prefill(L, W, stored_tokens=H)
- full depth (``--disable-ced``):     ReplayPlan.prefill(L, W, ced=False)

Decode steps under a plan are the same forward over the longer sequence with
the plan fixed at admission, which is what ``reference_generate`` does.
Quantisation is applied exactly where the engine stores bytes: global KV
(FP4 main record, MXFP4 index keys) and SWA KV (MXFP8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from engine.model.candidates import candidate_block_mask, select_topk, visible_entries
from engine.model.config import LayerRole
from engine.model.mhc import hc_collapse, hc_mix
from engine.model.model import DeepseekV41
from engine.model.precision import upcast
from engine.model.rope import rope_tail
from engine.model.sink_attention import sink_attention
from kernels.kv_formats import fake_quant_index_key, fake_quant_main_kv, fake_quant_swa


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """Which rows run which layers (docs/design/semantics.md).

    stored_tokens (H): global KV of tokens [0, H) comes from the store.
    encoder_start (e0): first row through layers < B and layer B's KV writes.
    decoder_start (d0): first row through layer B's query side and above.
    """

    stored_tokens: int = 0
    encoder_start: int = 0
    decoder_start: int = 0

    @classmethod
    def exact(cls) -> ReplayPlan:
        return cls()

    @classmethod
    def prefill(
        cls, num_tokens: int, replay_tokens: int, *, stored_tokens: int = 0, ced: bool = True
    ) -> ReplayPlan:
        e0 = max(0, stored_tokens - replay_tokens) if stored_tokens else 0
        d0 = max(e0, num_tokens - replay_tokens) if ced else e0
        return cls(stored_tokens, e0, d0)


@dataclass(frozen=True, slots=True)
class KVPrecision:
    """Storage precision of KV, as the engine stores it."""

    global_kv: Literal["fp4", "bf16", "exact"] = "fp4"
    swa: Literal["fp8", "exact"] = "fp8"


@dataclass(slots=True)
class GlobalKV:
    """Stored global KV per kv source layer: dequantised values, RoPE applied.

    latents[l]: [entries, head_dim]; keys[l]: [entries, index_head_dim].
    """

    latents: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)

    def prefix(self, tokens: int, ratios: dict[int, int]) -> GlobalKV:
        """The entries covering tokens [0, tokens): what a store holds after a hit."""
        return GlobalKV(
            {l: t[: tokens // ratios[l]] for l, t in self.latents.items()},
            {l: t[: tokens // ratios[l]] for l, t in self.keys.items()},
        )


@dataclass(slots=True)
class ReferenceOutput:
    logits: torch.Tensor  # [N - decoder_start, vocab], fp32
    global_kv: GlobalKV


def _store_global(x: torch.Tensor, precision: KVPrecision, fn) -> torch.Tensor:
    if precision.global_kv == "fp4":
        return fn(x)
    if precision.global_kv == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    return x


def _swa_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Key row k visible to query row t iff t - window < k <= t."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window)


def forward_train(
    model: DeepseekV41,
    input_ids: torch.Tensor,
    plan: ReplayPlan | None = None,
    stored: GlobalKV | None = None,
    precision: KVPrecision | None = None,
    trace: dict[str, dict[int, torch.Tensor]] | None = None,
) -> ReferenceOutput:
    """Run ``input_ids`` [N] under ``plan``; logits of rows [decoder_start, N).

    ``trace``, when given, receives per layer the query positions (``pos``), the
    selected compressed entries (``topk``) and the candidate mask (``candidates``)
    so tests can check each CSA2 role on its own.
    """
    config = model.config
    plan = plan or ReplayPlan.exact()
    precision = precision or KVPrecision()
    n = input_ids.shape[0]
    H, e0, d0 = plan.stored_tokens, plan.encoder_start, plan.decoder_start
    assert 0 <= e0 <= d0 < n, plan
    assert H == 0 or (e0 <= H < n and stored is not None), "stored tokens need stored KV"
    boundary = config.ced_boundary
    dtype = model.embed.weight.dtype
    hc = config.hc_mult
    ratios = {l: config.compress_ratios[l] for l in config.kv_source_layer_ids}

    pos = torch.arange(e0, n)
    R = model.embed(input_ids[e0:]).unsqueeze(1).expand(-1, hc, -1).contiguous()
    pre = torch.zeros(n - e0, hc, dtype=torch.float32)
    pre[:, 0] = 1.0  # the very first collapse takes copy 0 (ARCHITECTURE 1.3)

    kv_out = GlobalKV()
    topk: dict[int, torch.Tensor] = {}  # published top-k per index source, rows of this pass
    candidates: torch.Tensor | None = None

    for block in model.layers:
        l = block.layer_id
        attn = block.attn
        if block.engram is not None:
            R = block.engram(R, model.engram_rows(input_ids, int(pos[0]), n, l))
        pre_a, post_a, comb_a = block.hc_attn(R)
        x = block.attn_norm(hc_collapse(R, pre))
        kv = attn.project_kv(x, pos)
        if precision.swa == "fp8":
            kv = fake_quant_swa(kv)

        if l in ratios:  # kv source: append this pass's entries to the stored ones
            kv_out.latents[l], kv_out.keys[l] = _global_kv_of_source(
                block, ratios[l], x, pos, H, stored, precision
            )

        if l == boundary and d0 > int(pos[0]):
            # Replay cut: layer B's KV writes used every row; its query side and
            # everything above run on the last rows only.
            keep = d0 - int(pos[0])
            R, x, pos, pre = R[keep:], x[keep:], pos[keep:], pre[keep:]
            pre_a, post_a, comb_a = pre_a[keep:], post_a[keep:], comb_a[keep:]
            kv_keys, kv_pos = kv, torch.arange(e0, n)  # layer B reads its full window
        else:
            kv_keys, kv_pos = kv, pos
        if l > boundary and kv_keys.shape[0] != pos.shape[0]:
            raise AssertionError("decoder rows out of step")

        q, qr = attn.project_q(x, pos)
        keys = [kv_keys]
        masks = [_swa_mask(pos, kv_pos, config.sliding_window)]
        role = config.role(l)
        if role is not LayerRole.SWA_ONLY:
            src = config.kv_source(l)
            ratio = config.compress_ratios[l]
            latents = kv_out.latents[src]
            visible = visible_entries(pos, latents.shape[0], ratio)
            if role is LayerRole.REUSE:
                idx = topk[config.index_source(l)]
            else:
                qi, w = attn.indexer.queries(qr, x, pos)
                scores = attn.indexer.scores(qi, w, kv_out.keys[src])
                allowed = visible
                if role is LayerRole.REINDEX and candidates is not None:
                    allowed = visible & candidates
                if l == config.candidate_source_layer_id:
                    candidates = candidate_block_mask(
                        scores,
                        visible,
                        config.candidate_block_size,
                        config.candidate_topk_blocks,
                    )
                idx = select_topk(scores, allowed, config.index_topk)
                topk[l] = idx
            if trace is not None:
                trace.setdefault("topk", {})[l] = idx
                trace.setdefault("pos", {})[l] = pos
                if candidates is not None:
                    trace.setdefault("candidates", {})[l] = candidates
            chosen = torch.zeros(pos.shape[0], latents.shape[0] + 1, dtype=torch.bool)
            chosen.scatter_(1, torch.where(idx < 0, latents.shape[0], idx), True)
            keys.append(latents)
            masks.append(chosen[:, :-1])

        o = sink_attention(
            q,
            torch.cat(keys).to(q.dtype),
            torch.cat(masks, dim=1),
            attn.attn_sink,
            attn.softmax_scale,
        )
        R = hc_mix(R, attn.project_out(o, pos), post_a, comb_a)
        pre_f, post_f, comb_f = block.hc_ffn(R)
        x = block.ffn_norm(hc_collapse(R, pre_a))
        R = hc_mix(R, block.ffn(x), post_f, comb_f)
        pre = pre_f

    h = model.norm(hc_collapse(R, pre))
    logits = upcast(model.head(h.to(dtype)))
    return ReferenceOutput(logits, kv_out)


forward = torch.no_grad()(forward_train)
forward.__doc__ = "``forward_train`` without autograd: the oracle the engine is tested against."


def _global_kv_of_source(block, ratio, x, pos, H, stored, precision):
    """Stored entries below H plus this pass's complete groups starting at >= H."""
    attn = block.attn
    rows = x[H - int(pos[0]) :]
    latent = attn.compressor(rows)  # un-RoPE'd, complete groups only
    entry_pos = torch.arange(latent.shape[0]) * ratio + H  # RoPE at each group's start
    roped = rope_tail(latent, entry_pos, attn.inv_freq)
    new_latents = _store_global(roped, precision, fake_quant_main_kv)
    new_keys = _store_global(attn.indexer.keys(latent, entry_pos), precision, fake_quant_index_key)
    l = block.layer_id
    if H:
        old_l = stored.latents[l][: H // ratio]
        old_k = stored.keys[l][: H // ratio]
        return torch.cat([old_l, new_latents.to(old_l.dtype)]), torch.cat(
            [old_k, new_keys.to(old_k.dtype)]
        )
    return new_latents, new_keys


def forward_exact(model: DeepseekV41, input_ids: torch.Tensor, **kw) -> torch.Tensor:
    """Semantics 1: every layer over every token. Logits [N, vocab]."""
    return forward(model, input_ids, ReplayPlan.exact(), **kw).logits


@dataclass(slots=True)
class GenerateResult:
    tokens: list[int]
    logits: list[torch.Tensor]  # next-token logits at each step, [vocab] fp32
    plan: ReplayPlan
    global_kv: GlobalKV


@torch.no_grad()
def reference_generate(
    model: DeepseekV41,
    prompt: list[int],
    max_new_tokens: int,
    *,
    replay_tokens: int | None = None,
    ced: bool = True,
    stored_tokens: int = 0,
    stored: GlobalKV | None = None,
    precision: KVPrecision | None = None,
) -> GenerateResult:
    """Naive greedy generate: a dense forward per step with the admission plan fixed.

    The plan is chosen once, when the prompt is admitted (as the engine does);
    each decode step recomputes everything densely and takes the last row.
    """
    W = replay_tokens or model.config.sliding_window
    plan = ReplayPlan.prefill(len(prompt), W, stored_tokens=stored_tokens, ced=ced)
    tokens = list(prompt)
    out_tokens: list[int] = []
    step_logits: list[torch.Tensor] = []
    result = None
    for _ in range(max_new_tokens):
        result = forward(model, torch.tensor(tokens), plan, stored, precision)
        last = result.logits[-1]
        nxt = int(torch.argmax(last))
        step_logits.append(last)
        out_tokens.append(nxt)
        tokens.append(nxt)
    kv = result.global_kv if result is not None else GlobalKV()
    return GenerateResult(out_tokens, step_logits, plan, kv)
