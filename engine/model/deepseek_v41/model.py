"""The DeepSeek-V4.1-Flash text model: parameters under their official names, one forward.

``DeepseekV41.forward`` is the only layer loop. Where KV lives and which
kernels attend comes from a ``KVBackend`` (``kv_backend.py``): the dense one in
``dense_backend.py`` (the oracle and the training path) or the engine's paged one.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.base import CausalLM
from engine.model.deepseek_v41.attention import Selections
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.dspark.config import drafter_problem
from engine.model.deepseek_v41.dspark.drafter import DSparkDrafter
from engine.model.deepseek_v41.engram import engram_hash_windows
from engine.model.deepseek_v41.layer import Block
from engine.model.deepseek_v41.mhc import hc_collapse, hc_initial_pre
from engine.model.deepseek_v41.norm import RMSNorm
from engine.model.deepseek_v41.vision.aligner import Aligner
from engine.model.deepseek_v41.vision.config import image_token_id, vision_config
from engine.model.deepseek_v41.vision.image_plan import ImagePlan
from engine.model.deepseek_v41.vision.span import span_rows
from engine.model.deepseek_v41.vision.vit import VisionTransformer
from engine.model.kv.kv_backend import KVBackend
from engine.model.parallel import SINGLE, Parallel
from engine.model.precision import upcast

logger = logging.getLogger(__name__)


class DeepseekV41(CausalLM):
    """Embedding, ``num_hidden_layers`` blocks, final norm and head; with a
    ``vision_config``, the vision tower too (``vision.*``, ``aligner.*`` and the
    span vectors ``image_start``, ``image_newline``, ``image_end``, at the root as
    in the release).

    With ``num_nextn_predict_layers`` > 0 the DSpark drafter too (``mtp``: its
    stages ``mtp.<i>.*``, registered last so a seed gives the same text and vision
    weights with or without it); ``dspark`` is it, or None (no drafter in the config,
    or ``drop_drafter`` ran because the checkpoint carries none).
    """

    engram_vocab_map: torch.Tensor
    vision: VisionTransformer | None
    aligner: Aligner | None
    mtp: DSparkDrafter | None

    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        # This rank's TP / EP shares (docs/design/parallelism.md); SINGLE: the whole model.
        self.parallel = parallel
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Block(config, l, parallel) for l in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Token id -> Engram compressed class. Derived from the tokenizer, not a
        # checkpoint tensor; filled by `set_compressed_vocab`.
        self.register_buffer(
            "engram_vocab_map", torch.zeros(config.vocab_size, dtype=torch.long), persistent=False
        )
        # Every position of an image span carries this id (None: no image token).
        self.image_token_id = image_token_id(config)
        # Registered after the text model so its tensors keep their state_dict
        # order (and a seed its text weights).
        vision = vision_config(config)
        self.vision = self.aligner = None
        if vision is not None:
            self.vision = VisionTransformer(vision)
            self.aligner = Aligner(vision, config.hidden_size)
            self.image_start = nn.Parameter(torch.zeros(config.hidden_size))
            self.image_newline = nn.Parameter(torch.zeros(config.hidden_size))
            self.image_end = nn.Parameter(torch.zeros(config.hidden_size))
        # One process only for now: the stages would need their own TP / EP shares.
        single = parallel.tp_size == 1 and parallel.ep_size == 1
        self.mtp = None
        if config.num_nextn_predict_layers and single:
            problem = drafter_problem(config)
            if problem is None:
                self.mtp = DSparkDrafter(config)
            else:  # a text-only variant (e.g. a test's smaller vocabulary): no drafter
                logger.warning("DSpark drafter not built: %s", problem)

    @property
    def dspark(self) -> DSparkDrafter | None:
        """The DSpark drafter (its stages ``mtp.*``), or None."""
        return self.mtp

    def drop_drafter(self) -> None:
        """Forget the drafter: the checkpoint has no ``mtp.*`` tensors (an export
        without one, the demo model before its drafter is trained)."""
        self.mtp = None

    @property
    def blocks(self) -> list[Block]:
        """The layers, typed (an ``nn.ModuleList`` types its items as ``Module``)."""
        return cast(list[Block], list(self.layers))

    def block(self, layer_id: int) -> Block:
        return cast(Block, self.layers[layer_id])

    @property
    def encoder_only(self) -> bool:
        """True once ``drop_decoder_layers`` ran: only prefill-only work can run."""
        return len(self.layers) < self.config.num_hidden_layers

    def drop_decoder_layers(self) -> None:
        """Keep layers ``[0, B]`` (B = the CED boundary) and free the rest.

        A prefill worker runs the encoder path only (the encoder layers and
        layer B's KV writes); the decoder layers hold about half of the
        weights and are never read there. The final norm and head stay (small).
        """
        self.layers = self.layers[: self.config.ced_boundary + 1]

    def set_compressed_vocab(self, vocab_map: torch.Tensor) -> None:
        if vocab_map.shape != (self.config.vocab_size,):
            raise ValueError(
                f"compressed vocab map has shape {tuple(vocab_map.shape)}, "
                f"expected ({self.config.vocab_size},)"
            )
        self.engram_vocab_map.copy_(vocab_map)

    def engram_rows(
        self, token_ids: torch.Tensor, start: int, end: int, layer_id: int
    ) -> torch.Tensor:
        """Engram table rows of positions [start, end) of ``token_ids``.

        Each n-gram reaches ``engram_max_ngram_size - 1`` tokens back, across
        chunk boundaries; positions before 0 take the pad token's class.
        """
        n = self.config.engram_max_ngram_size
        missing = (n - 1) - min(start, n - 1)
        ids = token_ids[max(0, start - (n - 1)) : end]
        ids = torch.cat([ids.new_full((missing,), -1), ids])
        return self.engram_window_rows(ids.long().unfold(0, n, 1), layer_id)

    def engram_window_rows(self, windows: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Engram table rows of rows whose last n token ids are ``windows`` [T, n]
        (-1 before the sequence start: the pad token's class).

        An n-gram never reaches through an image position: from the newest image
        token of a window back, every slot takes the pad class, as before the
        sequence start (the row of an image position itself is all pad).
        """
        pad = self.engram_vocab_map[self.config.engram_pad_token_id]
        blocked = windows < 0
        if self.image_token_id is not None:
            image = windows == self.image_token_id
            # Slot j is cut when any slot j..n-1 (it or a newer one) is an image position.
            blocked = blocked | image.flip(1).cummax(dim=1).values.flip(1)
        classes = self.engram_vocab_map[windows.clamp(min=0)]
        return engram_hash_windows(torch.where(blocked, pad, classes), self.config, layer_id)

    # ----------------------------------------------------------------- images
    @property
    def takes_images(self) -> bool:
        return self.vision is not None

    def encode_image(self, patches: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """The ``plan.tokens`` rows [T, hidden] an image's span feeds the language model,
        from its ``patches`` (``image_pixels.image_patches``): ViT, aligner, span vectors."""
        if self.vision is None or self.aligner is None:
            raise ValueError("this model has no vision tower")
        features = self.vision(patches.to(self.embed.weight.device), plan.n_vit_h, plan.n_vit_w)
        cells = self.aligner(features, plan.n_vit_h, plan.n_vit_w)
        return span_rows(
            cells.to(self.embed.weight.dtype),
            plan.n_llm_h,
            plan.n_llm_w,
            self.image_start,
            self.image_newline,
            self.image_end,
        )

    def input_embeddings(
        self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[T, hidden]: the token embeddings, the image rows replaced by ``image_embeds``.

        ``image_embeds [k, hidden]``: one row per image position of ``input_ids``
        (the placeholder id), in order; a chunk that cuts a span passes the rows
        of its part of the span.
        """
        x = self.embed(input_ids)
        if image_embeds is None:
            return x
        if self.image_token_id is None:
            raise ValueError("image rows given to a model without an image token")
        where = input_ids == self.image_token_id
        count = int(where.sum())
        if count != image_embeds.shape[0]:
            raise ValueError(
                f"{image_embeds.shape[0]} image rows for {count} image positions in the rows"
            )
        return x.masked_scatter(where[:, None], image_embeds.to(x.dtype))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, std: float | None = None) -> None:
        """Deterministic random init for tiny demo checkpoints and tests.

        Linear weights and tables ~ N(0, std), norms = 1, biases and mHC bases = 0,
        mHC scales = 1, attention sinks = 0: activations stay O(1) through every
        layer because each sublayer input is RMS-normalised.
        """
        std = self.config.initializer_range if std is None else std
        # In checkpoint order and names (routed experts one by one, as views of
        # their stacked parameters), so a seed gives the same tensors whatever
        # the experts' storage.
        for name, p in self.state_dict(keep_vars=True).items():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight")) or leaf.endswith(
                "_scale"
            ):
                p.fill_(1.0)
            elif leaf in ("bias", "bias_vl", "attn_sink") or leaf.endswith("_base"):
                p.zero_()
            else:
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
                p.copy_(noise * std)

    @torch.no_grad()
    def idle_layers(self, first: int = 0) -> None:
        """Enter the MoE of layers ``first`` on with no rows of our own.

        Under EP dispatch (DP attention) every rank must join every MoE layer's
        two all-to-alls in a step, also a rank without rows (or whose rows all
        stopped below the last layer): the others' pairs need its experts.
        Without dispatch a rank has nothing to join, and this does nothing.
        """
        if not self.parallel.ep_dispatch:
            return
        x = self.embed.weight.new_zeros(0, self.config.hidden_size)
        for block in self.blocks[first:]:
            block.ffn(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        kv: KVBackend | None = None,
        trace: dict[str, dict[int, torch.Tensor]] | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 logits [rows, vocab] of ``kv.logit_rows()`` for the rows ``input_ids`` [T].

        ``kv`` defaults to the dense backend under the exact semantics (every
        layer over every token): ``model(ids)`` is the training forward.
        ``image_embeds``: the rows of the image positions (``input_embeddings``);
        they replace those embeddings before the hyper-connection expansion.
        """
        if kv is None:
            from engine.model.kv.dense_backend import DenseKV  # the default oracle backend

            kv = DenseKV.exact(self.config, input_ids)
        hc, n = self.config.hc_mult, self.config.engram_max_ngram_size
        R = self.input_embeddings(input_ids, image_embeds)
        R = R.unsqueeze(1).expand(-1, hc, -1).contiguous()
        pre = hc_initial_pre(R.shape[0], hc, R.device)
        image_rows = None if self.image_token_id is None else input_ids == self.image_token_id
        sel = Selections(trace=trace, image_rows=image_rows)
        for i, block in enumerate(self.blocks):
            rows = None
            if block.engram is not None:
                rows = self.engram_window_rows(kv.token_windows(n), block.layer_id)
            R, pre = block(R, pre, rows, kv, sel)
            if R.shape[0] == 0:  # no row goes on (a prefill-only pass past layer B)
                self.idle_layers(i + 1)
                return torch.zeros(0, self.config.vocab_size, device=R.device)
        keep = kv.logit_rows()
        if keep is not None:
            R, pre = R[keep], pre[keep]
        h = self.norm(hc_collapse(R, pre))
        # The head runs in fp32, as the release computes its logits.
        return F.linear(upcast(h), upcast(self.head.weight, h))
