"""The dense KV backend: one whole sequence, every key in a plain tensor.

Attention is a masked dense softmax (``sink_attention``), index scores a dense
matrix, global KV a tensor per kv source. Quantisation is applied where the
engine stores bytes (``KVPrecision``): global KV through the FP4 main record and
the MXFP4 index key, SWA KV through the MXFP8 record. Slow and obviously right:
the oracle for the paged engine, and the training path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from engine.model.deepseek_v41.candidates import visible_entries
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.indexer import indexer_scores
from engine.model.deepseek_v41.sink_attention import sink_attention
from engine.model.semantics.replay import ReplayPlan
from kernels.kv_formats import fake_quant_index_key, fake_quant_main_kv, fake_quant_swa


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


def _swa_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Key row k visible to query row t iff t - window < k <= t."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) & (diff < window)


class DenseKV:
    """``KVBackend`` over the rows ``[plan.starts[0], len(token_ids))`` of one sequence.

    ``stored`` holds the global KV of tokens ``[0, plan.stored_tokens)`` (the
    store's prefix); after the forward, ``global_kv`` holds it followed by every
    entry this pass completed.
    """

    def __init__(
        self,
        config: ModelConfig,
        token_ids: torch.Tensor,
        plan: ReplayPlan,
        stored: GlobalKV | None = None,
        precision: KVPrecision | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        n = token_ids.shape[0]
        H = plan.stored_tokens
        assert len(plan.starts) == config.num_hidden_layers + 1, plan
        assert H == 0 or stored is not None, "stored tokens need stored KV"
        self.plan = plan
        self.token_ids = token_ids
        self.precision = precision or KVPrecision()
        self.window = config.sliding_window
        self.ratios = {l: config.compress_ratios[l] for l in config.kv_source_layer_ids}
        self._pos = torch.arange(plan.starts[0], n, device=token_ids.device)
        self._swa: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.global_kv = GlobalKV()
        for l, ratio in self.ratios.items():
            assert H % ratio == 0, "a stored prefix ends on a group boundary"
            if H:
                assert stored is not None
                self.global_kv.latents[l] = stored.latents[l][: H // ratio].to(dtype)
                self.global_kv.keys[l] = stored.keys[l][: H // ratio].to(dtype)
            else:
                device = token_ids.device
                self.global_kv.latents[l] = torch.zeros(
                    0, config.head_dim, dtype=dtype, device=device
                )
                self.global_kv.keys[l] = torch.zeros(
                    0, config.index_head_dim, dtype=dtype, device=device
                )

    @classmethod
    def exact(
        cls, config: ModelConfig, token_ids: torch.Tensor, precision: KVPrecision | None = None
    ) -> DenseKV:
        """Every layer over every token (the training forward); KV quantised as stored
        unless ``precision`` says otherwise, as the release trains it."""
        return cls(config, token_ids, ReplayPlan.exact(config), precision=precision)

    # ------------------------------------------------------------ KVBackend
    @property
    def positions(self) -> torch.Tensor:
        return self._pos

    def keep_rows(self, layer_id: int) -> torch.Tensor | None:
        first = self.plan.starts[layer_id + 1]
        if self._pos.numel() == 0 or int(self._pos[0]) >= first:
            return None
        keep = torch.nonzero(self._pos >= first).flatten()
        self._pos = self._pos[keep]
        return keep

    def token_windows(self, n: int) -> torch.Tensor:
        at = self._pos[:, None] - (n - 1) + torch.arange(n, device=self._pos.device)[None, :]
        return torch.where(at >= 0, self.token_ids[at.clamp(min=0)], -1)

    def store_swa(self, layer_id: int, kv: torch.Tensor) -> None:
        if self.precision.swa == "fp8":
            kv = fake_quant_swa(kv)
        self._swa[layer_id] = (kv, self._pos)

    def compressor_groups(
        self, layer_id: int, raw: torch.Tensor, ratio: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        H = self.plan.stored_tokens
        first = H - int(self._pos[0]) if self._pos.numel() else 0
        assert first >= 0, "a kv source's rows start at or below the stored prefix"
        rows = raw[first:]
        complete = rows.shape[0] // ratio * ratio  # an open last group is no entry
        entry_ids = torch.arange(complete // ratio, device=raw.device) + H // ratio
        return rows[:complete], entry_ids

    def store_global(
        self, layer_id: int, entry_ids: torch.Tensor, latent: torch.Tensor, index_key: torch.Tensor
    ) -> None:
        old_l, old_k = self.global_kv.latents[layer_id], self.global_kv.keys[layer_id]
        assert int(entry_ids[0]) == old_l.shape[0], "entries are appended in order"
        latent, index_key = (
            self._as_stored(latent, fake_quant_main_kv),
            self._as_stored(index_key, fake_quant_index_key),
        )
        self.global_kv.latents[layer_id] = torch.cat([old_l, latent.to(old_l.dtype)])
        self.global_kv.keys[layer_id] = torch.cat([old_k, index_key.to(old_k.dtype)])

    def index_scores(
        self, source_id: int, qi: torch.Tensor, weights: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.global_kv.keys[source_id]
        scores = indexer_scores(qi, weights, keys, scale)
        return scores, visible_entries(self._pos, keys.shape[0], self.ratios[source_id])

    def index_scores_at(
        self,
        source_id: int,
        qi: torch.Tensor,
        weights: torch.Tensor,
        scale: float,
        entries: torch.Tensor,
    ) -> torch.Tensor:
        # The oracle keeps the dense scores and picks the listed columns out of them.
        scores, _ = self.index_scores(source_id, qi, weights, scale)
        picked = scores.gather(1, entries.clamp(min=0))
        return picked.masked_fill(entries < 0, float("-inf"))

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        source_id: int | None,
        selection: torch.Tensor | None,
        sink: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        swa_keys, swa_pos = self._swa[layer_id]
        keys = [swa_keys]
        masks = [_swa_mask(self._pos, swa_pos, self.window)]
        if selection is not None:
            assert source_id is not None
            latents = self.global_kv.latents[source_id]
            n = latents.shape[0]
            chosen = torch.zeros(q.shape[0], n + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(1, torch.where(selection < 0, n, selection), True)
            keys.append(latents)
            masks.append(chosen[:, :-1])
        return sink_attention(q, torch.cat(keys).to(q.dtype), torch.cat(masks, dim=1), sink, scale)

    def logit_rows(self) -> torch.Tensor | None:
        return None  # every row left after the last layer: [plan.starts[-1], n)

    # ------------------------------------------------------------ internals
    def _as_stored(self, x: torch.Tensor, fake_quant) -> torch.Tensor:
        if self.precision.global_kv == "fp4":
            return fake_quant(x)
        if self.precision.global_kv == "bf16":
            return x.to(torch.bfloat16).to(x.dtype)
        return x
