"""The DeepSeek-V4.1-Flash text model: parameters under their official names.

``DeepseekV41`` owns the weights. How they are applied lives in
``reference.py`` (the dense oracle) and in the engine's model runner, which
share every sub-module (attention projections, compressor, indexer, MoE, mHC).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.engram import engram_hash_rows
from engine.model.layer import Block
from engine.model.norm import RMSNorm


class DeepseekV41(nn.Module):
    """Embedding, ``num_hidden_layers`` blocks, final norm and head.

    DSpark (``mtp.*``) and vision weights are not part of the text model; the
    loader skips them with a notice.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, l) for l in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Token id -> Engram compressed class. Derived from the tokenizer, not a
        # checkpoint tensor; filled by `set_compressed_vocab`.
        self.register_buffer(
            "engram_vocab_map", torch.zeros(config.vocab_size, dtype=torch.long), persistent=False
        )

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
        history = self.config.engram_max_ngram_size - 1
        classes = self.engram_vocab_map[token_ids[max(0, start - history) : end]]
        missing = history - min(start, history)
        if missing:
            pad = self.engram_vocab_map[self.config.engram_pad_token_id]
            classes = torch.cat([pad.expand(missing), classes])
        return engram_hash_rows(classes, self.config, layer_id)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, std: float | None = None) -> None:
        """Deterministic random init for tiny demo checkpoints and tests.

        Linear weights and tables ~ N(0, std), norms = 1, biases and mHC bases = 0,
        mHC scales = 1, attention sinks = 0: activations stay O(1) through every
        layer because each sublayer input is RMS-normalised.
        """
        std = self.config.initializer_range if std is None else std
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or leaf.endswith("_scale"):
                p.fill_(1.0)
            elif leaf in ("bias", "attn_sink") or leaf.endswith("_base"):
                p.zero_()
            else:
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32)
                p.copy_(noise * std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of every position under the exact semantics (ARCHITECTURE 2.1.1)."""
        from engine.model.reference import forward_exact

        return forward_exact(self, input_ids)
