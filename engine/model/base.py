"""``CausalLM``: what the engine outside a model's folder may use of a model.

The loader, the builder, the runners and the planners hold a model as a
``CausalLM`` and construct it through the registry (engine/model/registry.py),
never by its class. A variant subclasses it; its blocks keep the interface of
DeepSeek-V4.1's ``Block`` (engine/model/deepseek_v41/layer.py), which the paged
runner and the CUDA graphs replay piece by piece.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.layer import Block
from engine.model.kv.kv_backend import KVBackend
from engine.model.parallel import Parallel


class CausalLM(nn.Module, ABC):
    """A text model: embedding, blocks, final norm and head, one forward over a KV backend."""

    config: ModelConfig
    parallel: Parallel  # this rank's TP / EP shares
    embed: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    head: nn.Linear
    # Rows whose token is this id are image positions (None: the model has no image token).
    image_token_id: int | None = None

    @property
    @abstractmethod
    def blocks(self) -> list[Block]:
        """The layers, typed."""

    @abstractmethod
    def block(self, layer_id: int) -> Block: ...

    @property
    @abstractmethod
    def encoder_only(self) -> bool:
        """True once ``drop_decoder_layers`` ran: only prefill-only work can run."""

    @abstractmethod
    def drop_decoder_layers(self) -> None:
        """Keep the layers up to the CED boundary (a prefill worker's model)."""

    def drop_drafter(self) -> None:
        """Forget the speculative drafter (the checkpoint has none); a model without one
        has nothing to drop."""
        return None

    @abstractmethod
    def set_compressed_vocab(self, vocab_map: torch.Tensor) -> None:
        """Token id -> Engram class, from the checkpoint's tokenizer."""

    @abstractmethod
    def engram_window_rows(self, windows: torch.Tensor, layer_id: int) -> torch.Tensor: ...

    @abstractmethod
    def init_weights(self, generator: torch.Generator, std: float | None = None) -> None:
        """Deterministic random weights (tiny checkpoints, tests)."""

    @abstractmethod
    def idle_layers(self, first: int = 0) -> None:
        """Join the collectives of layers ``first`` on with no rows of this rank's own."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        kv: KVBackend | None = None,
        trace: dict[str, dict[int, torch.Tensor]] | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 logits of ``kv.logit_rows()`` for the rows ``input_ids``; ``image_embeds``:
        the rows of its image positions (a model with a vision tower)."""


class DrafterHost(nn.Module):
    """A model's speculative drafter with what it borrows of the target (the embedding
    and the head) and none of the target's layers: the engine core's drafter under
    parallel serving (``ModelSpec.drafter_class``, ``load_drafter``)."""

    config: ModelConfig
    embed: nn.Embedding
    head: nn.Linear
