"""Quantised activations shared by the packed CPU GEMMs that read the same tensor.

Several packed linears consume one activation: attention's ``wkv`` and
``wq_a`` read the layer input, the attention's and the indexer's ``wq_b`` read
``qr``, and the routed experts' gate and up projections and the shared
expert's ``w1`` and ``w3`` all read the MoE input. The quantisation
(``kernels.act_quant``) depends on the tensor's values alone, so it is
computed once and reused while the tensor lives unchanged:

* keyed by the tensor's identity, its shape and its version counter (every
  in-place write bumps it, views share it), so a modified tensor is
  quantised again;
* held through a weak reference whose callback drops the entry when the
  tensor is freed, so the memo never keeps an activation's memory alive;
* one small table per thread; inference-mode tensors (no version counter)
  and tensors that require a gradient are not memoised;
* off while a CUDA graph is warmed up or captured (``suspended``): a graph's
  static buffers are the same tensors at every replay and a replay writes them
  without bumping their version, so an entry made in the warm-up would be read
  stale by the captured GEMM instead of quantising the replay's values.

A lookup costs a dict access and a weakref; a quantisation some ten tensor ops.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from kernels.act_quant import quantize_act_e4m3

# Live entries per thread; a layer has at most a few distinct GEMM inputs in flight.
MAX_ENTRIES = 8

_Entry = tuple[weakref.ref, int, torch.Size, tuple[torch.Tensor, torch.Tensor]]


class _Memo(threading.local):
    def __init__(self) -> None:
        self.entries: dict[int, _Entry] = {}
        self.suspended = 0


_MEMO = _Memo()


def _forget(entries: dict[int, _Entry], key: int) -> Callable[[weakref.ref], None]:
    def drop(ref: weakref.ref) -> None:
        entry = entries.get(key)
        if entry is not None and entry[0] is ref:  # not a newer tensor at the same id
            entries.pop(key, None)

    return drop


def quantize_act_shared(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_act_e4m3(x.reshape(-1, K))``, computed once per live, unmodified ``x``.

    Returns (E4M3 values as float32 ``[rows, K]``, scales ``[rows, K / 32]``); callers
    must not write into them (they are shared).
    """
    if _MEMO.suspended or x.is_inference() or (x.requires_grad and torch.is_grad_enabled()):
        return quantize_act_e4m3(x.reshape(-1, x.shape[-1]))
    entries = _MEMO.entries
    key = id(x)
    version = x._version
    entry = entries.get(key)
    if entry is not None and entry[0]() is x and entry[1] == version and entry[2] == x.shape:
        return entry[3]
    result = quantize_act_e4m3(x.reshape(-1, x.shape[-1]))
    if len(entries) >= MAX_ENTRIES:
        del entries[next(iter(entries))]  # the oldest
    entries[key] = (weakref.ref(x, _forget(entries, key)), version, x.shape, result)
    return result


@contextmanager
def suspended() -> Iterator[None]:
    """No memo inside (this thread): every call quantises, so a captured graph holds the
    quantisation of its own inputs (engine/runner/cuda_graphs.py)."""
    _MEMO.suspended += 1
    _MEMO.entries.clear()
    try:
        yield
    finally:
        _MEMO.suspended -= 1
        _MEMO.entries.clear()


def clear() -> None:
    """Drop this thread's entries (tests)."""
    _MEMO.entries.clear()
