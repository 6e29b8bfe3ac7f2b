"""``bench/anchor_transformers.py``: the flashserve side's FLOP count in the suite; the
transformers side (seconds of model build and generation) only on request."""

from __future__ import annotations

import os

import pytest
import torch

from bench.anchor_transformers import fs_flops_per_token, gemm_flops_per_s
from bench.engine_bench import tiny_model


def test_flops_per_token_count_the_head_and_the_layers() -> None:
    torch.set_grad_enabled(False)
    try:
        flops = fs_flops_per_token(tiny_model(), batch=2)
    finally:
        torch.set_grad_enabled(True)
    head = 2 * 256 * 129280  # the fp32 head alone, per token
    assert head < flops < 2 * head  # plus 8 small layers: about 0.09 GFLOP per token
    assert gemm_flops_per_s(n=128, repeats=2) > 1e8


@pytest.mark.skipif(
    not os.environ.get("FLASHSERVE_BENCH_ANCHOR"),
    reason="out of the suite: set FLASHSERVE_BENCH_ANCHOR=1 (builds a transformers model)",
)
def test_transformers_side_generates_the_requested_tokens() -> None:
    pytest.importorskip("transformers.models.deepseek_v4")
    from bench.anchor_transformers import NEW, hf_generate_tok_s, hf_model

    torch.set_grad_enabled(False)
    try:
        assert hf_generate_tok_s(hf_model(), 1) > 0  # asserts PROMPT + NEW tokens came back
    finally:
        torch.set_grad_enabled(True)
    assert NEW == 32
