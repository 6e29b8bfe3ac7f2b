"""The drafter without its target: ``mtp.*`` plus the target's embedding and head.

Under parallel serving the target's layers live on the worker ranks and the
DSpark proposer runs in the engine core (docs/design/parallelism.md,
"Speculative decoding"). The drafter borrows only the target's embedding and
head (docs/design/dspark.md), so the core loads those and the stages, under the
checkpoint's own names (``embed.weight``, ``head.weight``, ``mtp.<i>.*``), and
none of the target's layers.
"""

from __future__ import annotations

import logging

from torch import nn

from engine.model.base import DrafterHost
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.dspark.config import drafter_problem
from engine.model.deepseek_v41.dspark.drafter import DSparkDrafter
from engine.model.parallel import SINGLE, Parallel

logger = logging.getLogger(__name__)


class DSparkHost(DrafterHost):
    """``embed``, ``head`` and ``mtp`` of ``config``'s model, whole (one process's)."""

    embed: nn.Embedding
    head: nn.Linear
    mtp: DSparkDrafter | None

    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE) -> None:
        super().__init__()
        if parallel is not SINGLE:
            raise ValueError("the drafter host holds the whole drafter (one process)")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mtp = None
        problem = drafter_problem(config)
        if config.num_nextn_predict_layers and problem is None:
            self.mtp = DSparkDrafter(config)
        elif problem is not None:
            logger.warning("DSpark drafter not built: %s", problem)

    @property
    def dspark(self) -> DSparkDrafter | None:
        return self.mtp

    def drop_drafter(self) -> None:
        """The checkpoint has no ``mtp.*`` tensors."""
        self.mtp = None
