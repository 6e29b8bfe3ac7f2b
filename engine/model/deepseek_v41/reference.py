"""Dense reference forward: the oracle for every engine test.

The model's one forward (``DeepseekV41.forward``) over the dense backend
(``dense_backend.DenseKV``), under a ``ReplayPlan`` (``replay.py``,
docs/design/semantics.md):

- exact (training forward):           ReplayPlan.exact(config)
- CED prefill with bounded replay:    ReplayPlan.prefill(config, L, W)
- restore after a prefix hit of H:    ReplayPlan.prefill(config, L, W, stored_tokens=H)
- full depth (``--disable-ced``):     ReplayPlan.prefill(config, L, W, ced=False)

Decode steps under a plan are the same forward over the longer sequence with
the plan fixed at admission, which is what ``reference_generate`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.base import CausalLM
from engine.model.kv.dense_backend import DenseKV, GlobalKV, KVPrecision
from engine.model.semantics.replay import ReplayPlan

__all__ = ["GlobalKV", "KVPrecision", "ReferenceOutput", "ReplayPlan", "forward", "forward_train"]


@dataclass(slots=True)
class ReferenceOutput:
    logits: torch.Tensor  # [N - plan.logits_start, vocab], fp32
    global_kv: GlobalKV


def forward_train(
    model: CausalLM,
    input_ids: torch.Tensor,
    plan: ReplayPlan | None = None,
    stored: GlobalKV | None = None,
    precision: KVPrecision | None = None,
    trace: dict[str, dict[int, torch.Tensor]] | None = None,
    image_embeds: torch.Tensor | None = None,
) -> ReferenceOutput:
    """Run ``input_ids`` [N] under ``plan``; logits of rows [plan.logits_start, N).

    ``image_embeds``: the rows of the image positions among the rows the pass
    runs, ``input_ids[plan.encoder_start:]`` (``DeepseekV41.forward``).

    ``trace``, when given, receives per layer the query positions (``pos``), the
    selected compressed entries (``topk``) and the candidate mask (``candidates``)
    so tests can check each CSA2 role on its own.
    """
    config = model.config
    plan = plan or ReplayPlan.exact(config)
    kv = DenseKV(config, input_ids, plan, stored, precision, model.embed.weight.dtype)
    logits = model(input_ids[plan.encoder_start :], kv, trace, image_embeds=image_embeds)
    return ReferenceOutput(logits, kv.global_kv)


forward = torch.no_grad()(forward_train)
forward.__doc__ = "``forward_train`` without autograd: the oracle the engine is tested against."


def forward_exact(model: CausalLM, input_ids: torch.Tensor, **kw) -> torch.Tensor:
    """Semantics 1: every layer over every token. Logits [N, vocab]."""
    return forward(model, input_ids, ReplayPlan.exact(model.config), **kw).logits


@dataclass(slots=True)
class GenerateResult:
    tokens: list[int]
    logits: list[torch.Tensor]  # next-token logits at each step, [vocab] fp32
    plan: ReplayPlan
    global_kv: GlobalKV


@torch.no_grad()
def reference_generate(
    model: CausalLM,
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
    plan = ReplayPlan.prefill(model.config, len(prompt), W, stored_tokens=stored_tokens, ced=ced)
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
