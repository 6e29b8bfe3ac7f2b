"""``--speculative-config``: vLLM's JSON, parsed once at start."""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("dspark", "ngram")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``method``: the proposer; ``num_speculative_tokens`` (K): drafts per step;
    ``max_batch_size``: above this many running sequences a step decodes plainly
    (drafting costs more than it saves on a full batch); ``prompt_lookup_min/max``:
    the n-gram sizes the ``ngram`` method matches (vLLM's names); ``min_confidence``
    (``dspark`` only, not a vLLM key): drafts are cut at the first slot whose
    confidence-head probability is below it, so an unlikely draft costs no verify row."""

    method: str
    num_speculative_tokens: int
    max_batch_size: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    min_confidence: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method must be one of {list(METHODS)}, got {self.method!r}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1 (or absent)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.min_confidence is not None:
            if self.method != "dspark":
                raise ValueError("min_confidence applies to method 'dspark' only")
            if isinstance(self.min_confidence, bool) or not isinstance(
                self.min_confidence, int | float
            ):
                raise ValueError("min_confidence must be a number in [0, 1]")
            if not 0.0 <= self.min_confidence <= 1.0:
                raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the flag's JSON text; unknown keys are an error, not ignored."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}")
        if "method" not in data or "num_speculative_tokens" not in data:
            raise ValueError("--speculative-config needs 'method' and 'num_speculative_tokens'")
        return cls(**data)
