"""The DSpark drafter: ``num_nextn_predict_layers`` stages ``mtp.0 .. mtp.n-1``.

One round drafts a block of ``B = dspark_block_size`` tokens after an anchor
(the newest committed token, not yet run by the target):

1. context (per committed row): the target layers' block inputs, averaged over
   the mHC streams, concatenated in ``dspark_target_layer_ids`` order,
   ``main_norm(main_proj(.))`` (``mtp.0``); each stage projects it with its own
   ``wkv``/``kv_norm`` and RoPE at the row's position into its context ring.
2. block: ``[anchor, noise x (B-1)]`` at positions ``p .. p+B-1`` (``p``: the
   anchor's), embedded by the target's embedding, through every stage (mHC,
   SWA-only attention over the ring plus the whole block, MoE); collapsed with
   the last stage's FFN ``pre``; base logits ``head(norm(h))`` with the target's
   head and the last stage's ``norm``.
3. chain: slot ``j`` adds the Markov bias of its predecessor (the anchor for
   slot 0, else slot ``j-1``'s drafted token) and takes its greedy choice; the
   confidence head scores it.

Slot ``j`` predicts the token at position ``p + j + 1``: B drafts per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.deepseek_v41.attention import Selections
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.dspark.block_kv import DraftBlockKV
from engine.model.deepseek_v41.dspark.config import drafter_config
from engine.model.deepseek_v41.dspark.heads import ConfidenceHead, MarkovHead
from engine.model.deepseek_v41.fp8_linear import linear32
from engine.model.deepseek_v41.layer import Block
from engine.model.deepseek_v41.mhc import hc_collapse, hc_initial_pre
from engine.model.deepseek_v41.norm import RMSNorm
from engine.model.precision import upcast


class DSparkStage(Block):
    """``mtp.i``: an ordinary V4.1 block (layer id ``num_hidden_layers + i``, SWA only,
    the drafter's MoE sizes); stage 0 also holds the context projection
    (``main_proj``, ``main_norm``), the last stage the output ``norm`` and the heads."""

    main_proj: nn.Linear | None
    main_norm: RMSNorm | None
    norm: RMSNorm | None
    markov_head: MarkovHead | None
    confidence_head: ConfidenceHead | None

    def __init__(self, config: ModelConfig, stage: int) -> None:
        super().__init__(config, config.num_hidden_layers + stage)
        dim, eps = config.hidden_size, config.rms_norm_eps
        first, last = stage == 0, stage == config.num_nextn_predict_layers - 1
        n_targets = len(config.dspark_target_layer_ids)
        self.main_proj = nn.Linear(n_targets * dim, dim, bias=False) if first else None
        self.main_norm = RMSNorm(dim, eps) if first else None
        self.norm = RMSNorm(dim, eps) if last else None
        rank = config.dspark_markov_rank
        self.markov_head = MarkovHead(config.vocab_size, rank) if last else None
        self.confidence_head = ConfidenceHead(dim, rank) if last else None


@dataclass(frozen=True, slots=True)
class BlockDraft:
    """One round's output: ``tokens`` [B] (greedy, Markov-chained), ``logits`` [B, V]
    (base + Markov bias, fp32 or float64), ``confidence`` [B] in (0, 1)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor


class DSparkDrafter(nn.ModuleList):
    """The stages as the model's ``mtp`` list (so their names are the release's:
    ``mtp.<i>.<block name>``). The embedding and head are the target's, passed in."""

    def __init__(self, config: ModelConfig) -> None:
        draft = drafter_config(config)
        assert draft is not None, "num_nextn_predict_layers == 0: no drafter"
        super().__init__(DSparkStage(draft, i) for i in range(config.num_nextn_predict_layers))
        self.config = draft
        self.block_size = config.dspark_block_size
        self.noise_token_id = config.dspark_noise_token_id
        self.target_layer_ids = tuple(config.dspark_target_layer_ids)
        self.window = config.sliding_window

    @property
    def stages(self) -> list[DSparkStage]:
        return cast(list[DSparkStage], list(self))

    @property
    def layer_ids(self) -> list[int]:
        return [s.layer_id for s in self.stages]

    # ------------------------------------------------------------ context
    def context(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """``main_x`` [rows, D] from the target layers' block inputs ``R [rows, hc, D]``."""
        first = self.stages[0]
        assert first.main_proj is not None and first.main_norm is not None
        missing = [l for l in self.target_layer_ids if l not in features]
        if missing:
            raise ValueError(f"DSpark context needs target layers {missing}")
        dtype = features[self.target_layer_ids[0]].dtype
        # The stream mean in fp32, rounded to the model dtype as a stored activation.
        mean = [upcast(features[l]).mean(dim=-2).to(dtype) for l in self.target_layer_ids]
        x = linear32(torch.cat(mean, dim=-1), first.main_proj).to(dtype)
        return first.main_norm(x)

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each stage's context KV [rows, head_dim] of ``main_x`` at ``positions``."""
        return {s.layer_id: s.attn.project_kv(main_x, positions) for s in self.stages}

    # -------------------------------------------------------------- block
    def block_ids(self, anchor: int, device: torch.device | str | None = None) -> torch.Tensor:
        ids = torch.full((self.block_size,), self.noise_token_id, dtype=torch.long, device=device)
        ids[0] = anchor
        return ids

    def forward(
        self,
        anchors: list[int],
        positions: list[int],
        rings: list[dict[int, torch.Tensor]],
        embed: nn.Embedding,
        head: nn.Linear,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(base logits [N * B, V] in the compute dtype, collapsed pre-norm hidden
        [N * B, D]) of the blocks after ``anchors[i]`` at ``positions[i]``, each
        attending over its own ``rings[i]``: N rounds as one forward, rows
        sequence-major (the drafter's linears and experts run once for the batch)."""
        hc, b = self.config.hc_mult, self.block_size
        device = embed.weight.device
        ids = torch.cat([self.block_ids(a, device) for a in anchors])
        rows = torch.cat([torch.arange(p, p + b, device=device) for p in positions])
        R = embed(ids).unsqueeze(1).expand(-1, hc, -1).contiguous()
        pre = hc_initial_pre(R.shape[0], hc, R.device)
        kv = DraftBlockKV(rows, rings, b)
        for stage in self.stages:
            R, pre = stage(R, pre, None, kv, Selections())
        h = hc_collapse(R, pre)
        last = self.stages[-1]
        assert last.norm is not None
        normed = last.norm(h)
        return F.linear(upcast(normed), upcast(head.weight, normed)), h

    @torch.no_grad()
    def draft(
        self,
        anchor: int,
        position: int,
        rings: dict[int, torch.Tensor],
        embed: nn.Embedding,
        head: nn.Linear,
    ) -> BlockDraft:
        """The greedy block of one sequence (``draft_many`` of one)."""
        return self.draft_many([anchor], [position], [rings], embed, head)[0]

    @torch.no_grad()
    def draft_many(
        self,
        anchors: list[int],
        positions: list[int],
        rings: list[dict[int, torch.Tensor]],
        embed: nn.Embedding,
        head: nn.Linear,
    ) -> list[BlockDraft]:
        """Each sequence's greedy block: slot by slot, base logits plus the
        predecessor's Markov bias, the N sequences' slots side by side."""
        base, h = self(anchors, positions, rings, embed, head)
        n, b = len(anchors), self.block_size
        base = base.view(n, b, -1)
        last = self.stages[-1]
        assert last.markov_head is not None and last.confidence_head is not None
        prev = torch.tensor(anchors, dtype=torch.long, device=base.device)
        tokens, logits, codes = [], [], []
        for j in range(b):
            code = last.markov_head.code(prev)
            row = base[:, j] + last.markov_head.bias(code)
            prev = row.argmax(dim=-1)
            tokens.append(prev)
            logits.append(row)
            codes.append(code)
        code_rows = torch.stack(codes, dim=1).reshape(n * b, -1)  # sequence-major, as h
        confidence = last.confidence_head(h, code_rows).view(n, b)
        token_rows, logit_rows = torch.stack(tokens, dim=1), torch.stack(logits, dim=1)
        return [BlockDraft(token_rows[i], logit_rows[i], confidence[i]) for i in range(n)]
