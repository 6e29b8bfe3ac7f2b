"""Graph capture backends and the host-sync guard (docs/design/cuda-graphs.md).

A backend turns a callable into a replayable graph: ``capture(fn)`` runs ``fn``
once under capture and returns an object whose ``replay()`` re-issues the same
device work on the same memory. What ``fn`` decides on the host (Python
branches, caches, shapes) is frozen at capture; only tensor contents change.

- ``CudaGraphBackend``: ``torch.cuda.CUDAGraph``, one memory pool shared by
  every capture, warm-up on a side stream (Triton compiles and cuBLAS picks its
  workspace before capture, never during).
- ``RecordingGraphBackend``: the CPU stand-in. It records the aten operations
  ``fn`` dispatches (through a ``TorchDispatchMode``) and ``replay()`` re-runs
  that list on the recorded tensors: host decisions stay frozen exactly as in a
  CUDA graph, so the bookkeeping around graphs is tested without CUDA. It
  also fails a capture that reads a tensor made outside the graph and outside
  the declared static memory (a hidden cache a CUDA graph would read stale).

Both run the capture under ``SyncGuard``, which fails on operations that need
the host to read device data (``.item()``, ``nonzero``, boolean masks,
``bincount``...) or that copy host data in (``torch.tensor`` of a list):
CUDA refuses both during capture, the guard says which op, also on a CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

# Ops that read device values on the host (or size their output by them) on CUDA.
_SYNC_OPS = {
    aten._local_scalar_dense,  # .item(), int(t), bool(t), float(t), .tolist()
    aten.nonzero,
    aten.masked_select,
    aten.bincount,  # sizes its output by max(): two reads on CUDA
    aten.unique_consecutive,
    aten._unique2,
    aten.unique_dim,
    aten.equal,
    aten.is_nonzero,
}
# Host data lifted into a tensor: an H2D copy from pageable memory during capture.
_HOST_COPY_OPS = {aten.lift_fresh}


class HostSyncError(RuntimeError):
    """A captured piece did something a CUDA graph cannot hold."""


def _python_scalar(t: Any) -> bool:
    """A lifted Python number (``x[i] = 1.0``): CUDA fills with it, no copy, no sync."""
    return isinstance(t, torch.Tensor) and t.dim() == 0 and t.device.type == "cpu"


def _to_host(func: Any, args: tuple, kwargs: dict) -> bool:
    """A device-to-host copy (``.cpu()``, ``.tolist()`` of a CUDA tensor)."""
    tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    if func.overloadpacket is aten._to_copy:
        target = kwargs.get("device")
        return bool(tensors) and tensors[0].is_cuda and target is not None and target.type == "cpu"
    return len(tensors) == 2 and tensors[0].device.type == "cpu" and tensors[1].is_cuda


def _sync_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    packet = func.overloadpacket
    if packet in _SYNC_OPS:
        return "reads device data on the host"
    if packet in _HOST_COPY_OPS and not _python_scalar(args[0]):
        return "copies host data into a tensor (torch.tensor of Python values)"
    if packet in (aten.index, aten.index_put, aten.index_put_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices or ()):
            return "indexes by a boolean mask (a nonzero underneath)"
    if packet in (aten._to_copy, aten.copy_) and _to_host(func, args, kwargs):
        return "copies device data to the host"
    repeats = args[0] if args else None
    if (
        packet is aten.repeat_interleave
        and kwargs.get("output_size") is None
        and isinstance(repeats, torch.Tensor)
        and len(args) < 3
    ):
        return "repeat_interleave by a tensor without output_size"
    return None


# Python-level reads of tensor values: on a CPU tensor they read memory without
# dispatching an aten op, so only the function layer sees them.
_HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class _HostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            raise HostSyncError(f"{func.__name__} reads device data on the host: not capturable")
        return func(*args, **(kwargs or {}))


class SyncGuard(TorchDispatchMode):
    """Raise ``HostSyncError`` on the first op that a CUDA graph capture would refuse.

    Two layers: this dispatch mode sees aten ops (``nonzero``, boolean masks,
    ``bincount``, ``torch.tensor`` of a list); a function mode entered with it sees
    ``.tolist()``, ``.item()``, ``bool(t)``, ``int(t)`` even on a CPU tensor.
    """

    def __enter__(self):
        self._reads = _HostReads()
        self._reads.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._reads.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc, tb):
        try:
            return super().__exit__(exc_type, exc, tb)
        finally:
            self._reads.__exit__(exc_type, exc, tb)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(f"{func} {reason}: not capturable")
        return func(*args, **kwargs)


class Graph(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """What ``DecodeGraphs`` needs from a capture mechanism."""

    def warmup(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` eagerly before its capture (compiles, allocator, lazy buffers)."""
        ...

    def capture(self, fn: Callable[[], None], static: Iterable[torch.Tensor]) -> Graph:
        """``fn`` captured; ``static``: the memory ``fn`` may read besides its own results."""
        ...


# ------------------------------------------------------------------ CUDA


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph`` captures sharing one memory pool."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(self.device)

    def warmup(self, fn: Callable[[], None]) -> None:
        # The documented pattern: warm up on a side stream, then capture.
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                fn()
        current.wait_stream(self.stream)

    def capture(self, fn: Callable[[], None], static: Iterable[torch.Tensor]) -> Graph:
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA call (a KV tier's copy) does not void the capture.
        capture = torch.cuda.graph(
            graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
        )
        with capture, SyncGuard():
            fn()
        return graph


# ------------------------------------------------------------------ CPU recording


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Op:
    """One recorded aten call and how its replay treats it."""

    __slots__ = ("args", "func", "kind", "kwargs", "outs")

    def __init__(self, func: Any, args: tuple, kwargs: dict, outs: list, kind: str) -> None:
        self.func, self.args, self.kwargs, self.outs, self.kind = func, args, kwargs, outs, kind


def _kind(func: Any) -> str:
    """``mutate``: re-run (writes its arguments); ``view``: nothing to redo (aliases
    memory that is refreshed); ``compute``: re-run and copy into the recorded results."""
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "mutate"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    return "compute"


class RecordedGraph:
    """The aten ops of one capture, replayed on the tensors they ran on."""

    def __init__(self, ops: list[_Op]) -> None:
        self.ops = ops
        self.replays = 0

    @torch.no_grad()  # a graph replays kernels, not autograd (and views made under no_grad)
    def replay(self) -> None:
        for op in self.ops:
            if op.kind == "view":
                continue
            result = op.func(*op.args, **op.kwargs)
            if op.kind == "compute":
                fresh = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
                for recorded, new in zip(op.outs, fresh, strict=True):
                    if recorded.data_ptr() != new.data_ptr() or recorded.stride() != new.stride():
                        recorded.copy_(new)
        self.replays += 1


class _Recorder(SyncGuard):
    def __init__(self, allowed: set[int]) -> None:
        super().__init__()
        self.allowed = allowed  # storages the graph may read without producing them
        self.ops: list[_Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            raise HostSyncError(f"{func} {reason}: not capturable")
        lifted = func.overloadpacket in _HOST_COPY_OPS  # a Python scalar (checked above)
        for t in tree_flatten((args, kwargs))[0]:
            if lifted or not isinstance(t, torch.Tensor) or not t.numel():
                continue
            if _storage_key(t) not in self.allowed:
                raise HostSyncError(
                    f"{func} reads a tensor {tuple(t.shape)} {t.dtype} made outside this "
                    "graph and outside its static memory (a graph would read it stale)"
                )
        result = func(*args, **kwargs)
        outs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        for t in outs:
            self.allowed.add(_storage_key(t))
        self.ops.append(_Op(func, args, kwargs, outs, _kind(func)))
        return result


class RecordingGraphBackend:
    """The CPU stand-in for ``CudaGraphBackend`` (see the module doc)."""

    def __init__(self, constants: Iterable[torch.Tensor] = ()) -> None:
        # Memory every graph may read: the model's parameters and buffers.
        self.constants = {_storage_key(t) for t in constants}
        self.graphs: list[RecordedGraph] = []
        self.warmups = 0

    def warmup(self, fn: Callable[[], None]) -> None:
        self.warmups += 1
        fn()

    def capture(self, fn: Callable[[], None], static: Iterable[torch.Tensor]) -> RecordedGraph:
        recorder = _Recorder(self.constants | {_storage_key(t) for t in static})
        with recorder:
            fn()
        graph = RecordedGraph(recorder.ops)
        self.graphs.append(graph)
        return graph
