"""Engine rollouts: the engine's batched greedy continuation is the dense recompute's
token for token (greedy_rollout: the whole sequence re-run for every token), and
the features are the dense forward's."""

from __future__ import annotations

import torch

from engine.loader.checkpoint import skip_init
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from training.dspark_distill import greedy_rollout
from training.dspark_rollouts import engine_rollouts


def _tiny() -> DeepseekV41:
    with skip_init():  # init_weights draws every value; the constructor's would be lost
        model = DeepseekV41(ModelConfig.tiny())
    model.init_weights(torch.Generator().manual_seed(0))
    model.drop_drafter()
    with torch.no_grad():
        # Token identity dominates the residual stream, so the greedy stream moves
        # from id to id instead of settling on one: a wrong row shows.
        model.embed.weight.mul_(10)
    return model.eval()


def test_engine_rollouts_equal_the_dense_greedy_recompute() -> None:
    torch.manual_seed(0)
    model = _tiny()
    g = torch.Generator().manual_seed(1)
    # Lengths across the sliding window (16) and the compressed layers' ratios.
    prompts = [torch.randint(3, 129000, (n,), generator=g).tolist() for n in (5, 18)]
    new = 4
    made = engine_rollouts(model, prompts, new, max_num_seqs=2)
    assert made.rows == 2 * new and made.mismatches == 0
    for prompt, rollout in zip(prompts, made.rollouts, strict=True):
        dense = greedy_rollout(model, prompt, new)
        assert rollout.tokens == dense.tokens
        assert rollout.start == dense.start == len(prompt)
        assert len(set(rollout.tokens[len(prompt) :])) > 1  # the stream is not one id
        for layer in model.config.dspark_target_layer_ids:
            assert torch.equal(rollout.features[layer], dense.features[layer])
