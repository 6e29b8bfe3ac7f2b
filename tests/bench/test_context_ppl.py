"""bench/context_ppl.py's arithmetic: bytes per token (the text's UTF-8 length is the
oracle), perplexity and bits per byte by hand, and NLL rows against a log-softmax."""

from __future__ import annotations

import math

import pytest
import torch

from bench.context_ppl import STORED, Score, nll_rows, token_bytes
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.model import DeepseekV41
from engine.model.deepseek_v41.reference import forward
from training.demo_config import demo_checkpoint_dir


def test_token_bytes_sum_to_the_texts_utf8_length() -> None:
    tokenizer = load_tokenizer(demo_checkpoint_dir())
    sizes = token_bytes(tokenizer)
    text = '<｜begin▁of▁sentence｜>{"name": "café", "n": 12}\nO brave new world — 🎭'
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert int(sizes[torch.tensor(ids)].sum()) == len(text.encode("utf-8"))


def test_score_by_hand() -> None:
    score = Score()
    sizes = torch.tensor([1, 3, 2])
    score.add(torch.tensor([0.5, 1.5]), torch.tensor([1, 2]), sizes)
    assert (score.tokens, score.bytes) == (2, 5)
    assert score.ppl == pytest.approx(math.exp(1.0))
    assert score.bits_per_byte == pytest.approx(2.0 / math.log(2) / 5)


def test_nll_rows_are_the_next_token_log_softmax() -> None:
    model = DeepseekV41(ModelConfig.tiny().replace(vocab_size=64))
    model.init_weights(torch.Generator().manual_seed(0))
    model.eval()
    ids = torch.randint(3, 64, (20,), generator=torch.Generator().manual_seed(1))
    nll = nll_rows(model, ids)

    with torch.no_grad():
        logits = forward(model, ids, precision=STORED).logits
    expected = [-torch.log_softmax(logits[t].double(), -1)[ids[t + 1]] for t in range(19)]
    assert nll.shape == (19,)
    assert torch.allclose(nll, torch.stack(expected), atol=1e-9)
