"""The indexer's KL loss against a float64 loop over rows and entries (the oracle), and
its gradient reaching the indexer's weights only."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.reference import forward_train
from engine.model.kv.dense_backend import KVPrecision
from training.indexer_loss import AttentionInputs, indexer_kl, readers

CONFIG = ModelConfig.tiny().replace(vocab_size=512)
EXACT = KVPrecision("exact", "exact")


@pytest.fixture(scope="module")
def model() -> DeepseekV41:
    model = DeepseekV41(CONFIG)
    model.init_weights(torch.Generator().manual_seed(11), std=0.2)  # peaked attention
    return model


def test_readers_follow_the_csa2_roles(model: DeepseekV41) -> None:
    # tiny: 2 Full + 3 Reuse, 4 Full + 5 Reuse, 6 Reindex + 7 Reuse.
    assert {l: readers(model, l) for l in CONFIG.index_source_layer_ids} == {
        2: [2, 3],
        4: [4, 5],
        6: [6, 7],
    }


def _oracle(model: DeepseekV41, x: dict[int, torch.Tensor], latents: dict[int, torch.Tensor]):
    """sum over index layers of mean_t KL(p_t || q_t), one row and one entry at a time."""
    total = 0.0
    n = x[0].shape[0]
    pos = torch.arange(n)
    for l in CONFIG.index_source_layer_ids:
        src = CONFIG.kv_source(l)
        ratio = CONFIG.compress_ratios[src]
        lat = latents[src].double()
        source = model.layers[src].attn
        keys = source.indexer.keys(source.compressor(x[src]), torch.arange(lat.shape[0]) * ratio)
        _, qr = model.layers[l].attn.project_q(x[l], pos)
        indexer = model.layers[l].attn.indexer
        qi, w = indexer.queries(qr, x[l], pos)
        qs = {m: model.layers[m].attn.project_q(x[m], pos)[0].double() for m in readers(model, l)}
        kls = []
        for t in range(n):
            visible = [j for j in range(lat.shape[0]) if j < (t + 1) // ratio]
            if not visible:
                continue
            p = [0.0] * len(visible)
            for q in qs.values():
                for h in range(q.shape[1]):
                    logits = [float(q[t, h] @ lat[j]) / math.sqrt(CONFIG.head_dim) for j in visible]
                    top = max(logits)
                    e = [math.exp(v - top) for v in logits]
                    p = [a + b / sum(e) for a, b in zip(p, e, strict=True)]
            p = [v / sum(p) for v in p]
            scores = [
                sum(
                    float(w[t, h])
                    * max(0.0, float(qi[t, h].double() @ keys[j].double()))
                    * indexer.score_scale
                    for h in range(qi.shape[1])
                )
                for j in visible
            ]
            top = max(scores)
            log_z = top + math.log(sum(math.exp(s - top) for s in scores))
            kls.append(sum(a * (math.log(a) - (s - log_z)) for a, s in zip(p, scores, strict=True)))
        total += sum(kls) / len(kls)
    return total


def test_loss_equals_the_row_by_row_oracle(model: DeepseekV41) -> None:
    ids = torch.randint(3, 512, (12,), generator=torch.Generator().manual_seed(1))
    inputs = AttentionInputs(model)
    with torch.no_grad():
        out = forward_train(model, ids, precision=EXACT)
        loss = indexer_kl(model, inputs.x, out.global_kv)
        expected = _oracle(model, inputs.x, out.global_kv.latents)
    inputs.remove()
    assert expected > 1e-3  # the random indexer disagrees with attention
    assert float(loss) == pytest.approx(expected, rel=1e-4)


def test_gradient_reaches_only_the_indexer_and_lowers_the_loss(model: DeepseekV41) -> None:
    ids = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(2))
    inputs = AttentionInputs(model)
    model.zero_grad(set_to_none=True)
    out = forward_train(model, ids, precision=EXACT)
    loss = indexer_kl(model, inputs.x, out.global_kv)
    loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    expected = {
        f"layers.{l}.attn.indexer.{name}.weight"
        for l in CONFIG.index_source_layer_ids
        for name in ("wq_b", "weights_proj")
    } | {
        f"layers.{l}.attn.indexer.{name}.weight"
        for l in CONFIG.kv_source_layer_ids
        for name in ("wk", "k_norm")
    }
    assert with_grad == expected

    params = [p for n, p in model.named_parameters() if n in expected]
    optimizer = torch.optim.Adam(params, lr=1e-2)
    before = float(loss.detach())
    for _ in range(3):
        optimizer.step()
        optimizer.zero_grad()
        out = forward_train(model, ids, precision=EXACT)
        loss = indexer_kl(model, inputs.x, out.global_kv)
        loss.backward()
    inputs.remove()
    model.zero_grad(set_to_none=True)
    assert float(loss.detach()) < 0.9 * before
