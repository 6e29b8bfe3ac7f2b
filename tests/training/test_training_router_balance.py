"""Router bias steps by hand: experts above the mean load move down by the rate, below move up."""

from __future__ import annotations

import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from training.router_balance import RouterBalance


def test_bias_moves_towards_balance() -> None:
    config = ModelConfig.tiny().replace(vocab_size=512)  # 8 experts, 2 per token
    model = DeepseekV41(config)
    model.init_weights(torch.Generator().manual_seed(0))
    gate = model.layers[3].ffn.gate
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[0] = 1.0  # every token scores expert 0 highest ...
        gate.bias.copy_(torch.tensor([0, 0.5, 0, 0, 0, 0, 0, 0.1]))  # ... then 1 by its bias
    balance = RouterBalance(model, rate=0.01)
    x = torch.rand(4, config.hidden_size) + 0.1
    _, idx = gate(x)
    assert sorted(idx[0].tolist()) == [0, 1]
    # Counts [4, 4, 0, ...]: mean 1, so experts 0 and 1 go down, the rest up.
    load = balance.update()
    assert load == 4.0
    expected = torch.tensor([-0.01, 0.49, 0.01, 0.01, 0.01, 0.01, 0.01, 0.11])
    torch.testing.assert_close(gate.bias.detach(), expected)
    # Layers that routed nothing keep their bias; the counts restart after an update.
    assert torch.equal(model.layers[0].ffn.gate.bias, torch.zeros(8))
    assert float(balance.counts[3].sum()) == 0
    balance.remove()
    gate(x)
    assert float(balance.counts[3].sum()) == 0
