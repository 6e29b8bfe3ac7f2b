"""Per-request sampling parameters and the structured-output spec.

The server validates user input (pydantic) and builds one ``SamplingParams`` per
request; ``validate`` only re-checks the invariants the sampler and detokenizer
rely on, raising ``RequestError`` with the field named. Semantics of each field,
and the order the sampler applies them in, are in docs/design/engine.md,
"Sampling".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from engine.api.errors import RequestError

# OpenAI caps `top_logprobs` at 20.
MAX_TOP_LOGPROBS = 20
# Below this, dividing by the temperature overflows: such requests are greedy (as vLLM).
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """The output format a request must follow, as plain data: the engine compiles it
    (engine/structured_output/) and matches every sampled token against it.

    It crosses to an engine core process as these fields (a schema's few KB), never
    as a compiled grammar. The server builds it from the API request and checks the
    schemas first (server/chat/structured_output.py); what only compiling can tell
    comes back as a ``GrammarError`` naming ``param`` (or ``prefix_param``).

    - ``json_schema``: JSON text of the schema the answer satisfies, written compact
      (``{"type":"object"}`` for any object); None: no JSON answer.
    - ``tools``: JSON text of the functions a DSML calls block may call, as
      ``[{"name", "description"?, "parameters"}]``; None: no calls.
    - ``tool_choice`` (with tools): ``auto`` (a calls block may follow free text,
      or replace the JSON answer), ``required`` (calls only) or ``function`` (one
      call of ``function_name``).
    - ``starts_in_reasoning``: the prompt ends inside ``<think>``: free reasoning
      up to ``</think>`` comes first. ``prefix``: output text the prompt already
      holds (a chat prefix), which the grammar must accept before the first token.
    """

    json_schema: str | None = None
    tools: str | None = None
    tool_choice: Literal["auto", "required", "function"] = "auto"
    function_name: str | None = None
    parallel_tool_calls: bool = True
    starts_in_reasoning: bool = False
    prefix: str = ""
    param: str = "response_format"  # the API field a schema problem names
    prefix_param: str = "messages"  # the API field a prefix that does not fit names


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise RequestError(field_name, message)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop (OpenAI/vLLM semantics)."""

    temperature: float = 1.0  # 0 (below 1e-5) = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0  # 0 = off
    presence_penalty: float = 0.0  # on output tokens only
    frequency_penalty: float = 0.0  # on output tokens only
    repetition_penalty: float = 1.0  # on prompt and output tokens; 1 = off
    seed: int | None = None
    logprobs: int | None = None  # None = off; k = also return the top k
    # Score the prompt (vLLM's prompt_logprobs): None = off; k = each prompt token's
    # logprob under the model's raw distribution, with the top k. Such a request's
    # prompt rows all run at full depth (docs/design/semantics.md).
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    n: int = 1
    structured: StructuredOutputSpec | None = None  # None: free text

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``RequestError`` naming the field if an invariant does not hold."""
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", ">= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        _check(self.top_k >= -1, "top_k", ">= -1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        _check(math.isfinite(self.presence_penalty), "presence_penalty", "finite")
        _check(math.isfinite(self.frequency_penalty), "frequency_penalty", "finite")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "> 0",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "logprobs",
            f"None or in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
            "prompt_logprobs",
            f"None or in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(self.max_tokens >= 1, "max_tokens", ">= 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", "in [0, max_tokens]")
        _check(all(s for s in self.stop), "stop", "no empty strings")
        _check(self.n >= 1, "n", ">= 1")
        token_ids = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": list(self.logit_bias or {}),
        }
        for name, ids in token_ids.items():
            _check(all(i >= 0 for i in ids), name, "token ids >= 0")
            if vocab_size is not None:
                _check(all(i < vocab_size for i in ids), name, "ids < vocab")
        _check(
            all(math.isfinite(b) for b in (self.logit_bias or {}).values()),
            "logit_bias",
            "finite values",
        )

    @property
    def greedy(self) -> bool:
        """Argmax sampling (temperature 0, or too small to divide by)."""
        return self.temperature < GREEDY_TEMPERATURE
