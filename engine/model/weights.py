"""The storage formats a checkpoint stores a tensor in, and a model's name rules
saying which tensor is in which.

Each model's registry entry (engine/model/registry.py) carries its
``WeightRules`` (DeepSeek-V4.1's: engine/model/deepseek_v41/weight_names.py);
the loader, the writer and the planners ask those, and the shapes, bytes and
dequantisation of each format are engine/loader/formats.py. Here, below both,
so that a model's folder can name formats without importing the loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

SCALE_SUFFIX = ".scale"


class WeightFormat(StrEnum):
    """How one logical tensor is stored (docs/design/architecture.md §1.10)."""

    BF16 = "bf16"
    FP32 = "fp32"
    FP8_BLOCK = "fp8_block"  # F8_E4M3 + E8M0 `.scale` per [32, 32] block
    MXFP4 = "mxfp4"  # two E2M1 per I8 (even element low) + E8M0 `.scale` per 32 along K
    FP8_ROWS = "fp8_rows"  # F8_E4M3 + E8M0 `.scale` per 32 along each row (Engram tables)

    @property
    def quantised(self) -> bool:
        return self not in (WeightFormat.BF16, WeightFormat.FP32)


def scale_name(name: str) -> str:
    """The ``.scale`` sibling of a quantised weight: ``X.weight`` -> ``X.scale``."""
    return name.removesuffix(".weight") + SCALE_SUFFIX


@dataclass(frozen=True, slots=True)
class WeightRules:
    """Which stored tensor of a model's checkpoint is in which format, by name
    (the decision table of docs/design/checkpoints.md); what a load skips and
    what an export may leave out."""

    formats: tuple[tuple[re.Pattern[str], WeightFormat], ...]  # first full match wins
    skipped_kinds: tuple[tuple[str, tuple[str, ...]], ...]  # kind -> name prefixes not served
    optional_tensors: tuple[re.Pattern[str], ...]  # fullmatch: absent in an export, zeros
    # A vision tower's tensors: read by a model that has one, else skipped as "vision".
    vision_prefixes: tuple[str, ...] = ()
    # A speculative drafter's tensors: a checkpoint without any loads the model without it.
    drafter_prefixes: tuple[str, ...] = ()

    def format_of(self, name: str) -> WeightFormat | None:
        """The storage format of the model tensor ``name`` (None: not in the table)."""
        for pattern, fmt in self.formats:
            if pattern.fullmatch(name):
                return fmt
        return None

    def skipped(self, name: str, serves_vision: bool = False) -> str | None:
        """The kind of a stored tensor a load does not read, or None.

        ``serves_vision``: the model has a vision tower (its config a ``vision_config``),
        which reads the vision tensors.
        """
        for kind, prefixes in self.skipped_kinds:
            if name.startswith(prefixes):
                return kind
        if not serves_vision and self.vision_prefixes and name.startswith(self.vision_prefixes):
            return "vision"
        return None

    def is_vision(self, name: str) -> bool:
        return bool(self.vision_prefixes) and name.startswith(self.vision_prefixes)

    def is_drafter(self, name: str) -> bool:
        return bool(self.drafter_prefixes) and name.startswith(self.drafter_prefixes)

    def optional(self, name: str) -> bool:
        return any(p.fullmatch(name) for p in self.optional_tensors)
