"""Scores of prompt tokens (``SamplingParams.prompt_logprobs``), from prompt-row logits.

Row ``p`` of a prefill predicts token ``p + 1``. The distribution is the model's
raw one (``log_softmax`` of the logits; no bias, mask or penalty applies to a
token the client wrote), as vLLM reports prompt logprobs. Rows go through
``log_softmax`` in blocks so a long chunk never holds two [rows, vocab] copies.
"""

from __future__ import annotations

import torch

from engine.api.request import TokenLogprob
from engine.model.precision import upcast

_BLOCK_ROWS = 64


def score_rows(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``targets[i]`` under row ``i`` of ``logits`` [R, V], with the
    ``top`` best alternatives (best first). ``len(targets) <= R``: rows past the
    targets (the prompt's last row) are not scored."""
    out: list[TokenLogprob] = []
    for lo in range(0, len(targets), _BLOCK_ROWS):
        hi = min(lo + _BLOCK_ROWS, len(targets))
        logprobs = upcast(logits[lo:hi]).log_softmax(dim=-1)  # fp32; float64 stays
        ids = torch.tensor(targets[lo:hi], device=logits.device)
        chosen_t = logprobs.gather(1, ids[:, None])
        ranks = (1 + (logprobs > chosen_t).sum(dim=1)).tolist()
        chosen = chosen_t[:, 0].tolist()
        if top:
            values, alt = logprobs.topk(top, dim=-1)
            tops = [
                list(zip(a, v, strict=True))
                for a, v in zip(alt.tolist(), values.tolist(), strict=True)
            ]
        else:
            tops = [[] for _ in range(hi - lo)]
        out.extend(
            TokenLogprob(t, c, tp, r)
            for t, c, tp, r in zip(targets[lo:hi], chosen, tops, ranks, strict=True)
        )
    return out
