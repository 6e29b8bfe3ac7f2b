"""Prompt scoring (``SamplingParams.prompt_logprobs``): every prompt row at full depth.

Oracle: ``log_softmax`` of the dense reference's exact forward (every layer on
every row, KV in the stored formats) at each prompt position, for the token
that follows it; with a prefix-cache hit the pages supply global KV and the
scores do not change.
"""

from __future__ import annotations

import torch
from engine_helpers import greedy, prompt, reference_engine, run_to_completion

from engine.api.request import Request
from engine.model.deepseek_v41.reference import forward


def _oracle(model, tokens: list[int]) -> torch.Tensor:
    logits = forward(model, torch.tensor(tokens)).logits
    lp = logits.double().log_softmax(-1)
    return lp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]


def _scored(flavour, tokens: list[int], *, requests: int = 1, chunk: int = 16):
    engine, runner = reference_engine(
        flavour.model, runner=flavour.runner, prefill_chunk_tokens=chunk
    )
    outs = []
    for i in range(requests):
        params = greedy(2, prompt_logprobs=3)
        engine.add_request(Request(f"r{i}", tokens, params))
        outputs = run_to_completion(engine)[f"r{i}"]
        scored = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
        assert len(scored) == 1, "the scores come once"
        outs.append((scored[0], outputs[-1].usage, runner))
    return outs


def test_prompt_scores_equal_the_dense_log_softmax(flavour):
    tokens = prompt(45, 7)
    (scores, _, _), (again, usage, _) = _scored(flavour, tokens, requests=2)
    want = _oracle(flavour.model, tokens)
    atol = 1e-9 if flavour.model.embed.weight.dtype == torch.float64 else 1e-4
    for got in (scores, again):  # the second finds the prompt's pages cached
        assert [s.token_id for s in got] == tokens[1:]
        values = torch.tensor([s.logprob for s in got], dtype=torch.float64)
        torch.testing.assert_close(values, want, atol=atol, rtol=0)
        for s in got:  # the alternatives are the best three, best first, ranks agree
            assert len(s.top_logprobs) == 3
            assert s.top_logprobs[0][1] >= s.top_logprobs[1][1] >= s.top_logprobs[2][1]
            assert s.rank == 1 + sum(v > s.logprob for _, v in s.top_logprobs) or s.rank > 3
    assert usage.prompt_cache_hit_tokens == 40


def test_a_request_without_prompt_logprobs_gets_none(flavour):
    engine, _ = reference_engine(flavour.model, runner=flavour.runner)
    engine.add_request(Request("a", prompt(20, 3), greedy(2)))
    assert all(o.prompt_logprobs is None for o in run_to_completion(engine)["a"])
