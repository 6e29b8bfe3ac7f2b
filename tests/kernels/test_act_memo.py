"""The shared activation quantisation: reused only for the same live, unmodified tensor."""

from __future__ import annotations

import gc

import torch

from kernels import act_memo
from kernels.act_memo import quantize_act_shared
from kernels.act_quant import quantize_act_e4m3


def _equal(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_same_tensor_reuses_and_a_write_requantises() -> None:
    act_memo.clear()
    x = torch.randn(3, 64)
    first = quantize_act_shared(x)
    assert _equal(first, quantize_act_e4m3(x))
    assert quantize_act_shared(x) is first  # reused, not recomputed
    assert quantize_act_shared(x.clone()) is not first  # another tensor, same values
    x[0, 5] = 1000.0  # an in-place write bumps the version counter
    again = quantize_act_shared(x)
    assert again is not first and _equal(again, quantize_act_e4m3(x))
    view = x[1:]
    view.mul_(3.0)  # through a view: the same counter
    assert _equal(quantize_act_shared(x), quantize_act_e4m3(x))


def test_entries_die_with_their_tensor_and_stay_bounded() -> None:
    act_memo.clear()
    x = torch.randn(2, 32)
    quantize_act_shared(x)
    assert len(act_memo._MEMO.entries) == 1
    del x
    gc.collect()
    assert len(act_memo._MEMO.entries) == 0  # the weakref callback dropped it
    keep = [torch.randn(1, 32) for _ in range(3 * act_memo.MAX_ENTRIES)]
    for t in keep:
        quantize_act_shared(t)
    assert len(act_memo._MEMO.entries) == act_memo.MAX_ENTRIES


def test_rows_of_a_3d_input_and_inference_tensors() -> None:
    act_memo.clear()
    x = torch.randn(2, 3, 64)
    values, scales = quantize_act_shared(x)
    assert values.shape == (6, 64) and scales.shape == (6, 2)
    assert _equal((values, scales), quantize_act_e4m3(x.reshape(6, 64)))
    with torch.inference_mode():
        y = torch.randn(4, 32)
        assert _equal(quantize_act_shared(y), quantize_act_e4m3(y))  # not memoised
    assert len(act_memo._MEMO.entries) == 1


def test_suspended_quantises_every_call() -> None:
    """Inside ``suspended`` (a CUDA graph's warm-up and capture) nothing is reused: a
    captured GEMM must quantise its own input at every replay."""
    act_memo.clear()
    x = torch.randn(2, 64)
    outside = quantize_act_shared(x)
    with act_memo.suspended():
        inside = quantize_act_shared(x)
        assert inside is not outside and quantize_act_shared(x) is not inside
        assert _equal(inside, quantize_act_e4m3(x))
    after = quantize_act_shared(x)
    assert after is not outside  # the entries made before were dropped
    assert quantize_act_shared(x) is after  # and the memo works again
