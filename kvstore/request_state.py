"""Per-request KV state that is not paged and never persisted.

See docs/design/architecture.md §1.10 and §2.3.

- SWA windows: per layer a ring of ``sliding_window`` MXFP8 records (528 B);
  the record of position ``p`` lives in ring slot ``p % sliding_window``.
- Ratio-2 compressor state: per compressing kv source, the open group's raw
  fp32 ``[a | g]`` rows (``ratio - 1`` rows for ratio ``r``).

Both are rebuilt by replay after a restore, so they are sized by plain numbers
from the engine and live in preallocated slabs indexed by a request slot:
batched kernels gather a batch's windows with one slot index tensor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from kernels.kv_formats import SWA


class OutOfRequestSlots(RuntimeError):
    """Every request slot is taken; the scheduler must wait or preempt."""


@dataclass(frozen=True, slots=True)
class RequestStateLayout:
    """Sizes of one request's state, in the engine's plain numbers."""

    swa_layers: int  # layers with an SWA window: every layer (plus DSpark blocks if served)
    sliding_window: int
    swa_record_bytes: int = SWA.record_bytes
    compressor_sources: int = 0  # kv sources with ratio > 1
    compressor_rows: int = 1  # open-group rows kept: ratio - 1
    compressor_row_width: int = 1024  # [a | g]: 2 x head_dim fp32

    @classmethod
    def for_model(
        cls,
        swa_layers: int,
        sliding_window: int,
        kv_source_ratios: Sequence[int],
        head_dim: int,
        swa_record_bytes: int = SWA.record_bytes,
    ) -> RequestStateLayout:
        """From plain config numbers: one compressor state per kv source with ratio > 1."""
        grouped = [r for r in kv_source_ratios if r > 1]
        return cls(
            swa_layers=swa_layers,
            sliding_window=sliding_window,
            swa_record_bytes=swa_record_bytes,
            compressor_sources=len(grouped),
            compressor_rows=max(grouped, default=2) - 1,
            compressor_row_width=2 * head_dim,
        )

    @property
    def swa_bytes(self) -> int:
        return self.swa_layers * self.sliding_window * self.swa_record_bytes

    @property
    def compressor_bytes(self) -> int:
        return self.compressor_sources * self.compressor_rows * self.compressor_row_width * 4


class RequestStatePool:
    """Slabs of SWA rings and compressor rows for up to ``max_requests`` requests."""

    def __init__(self, layout: RequestStateLayout, max_requests: int, device: str = "cpu") -> None:
        self.layout = layout
        self.max_requests = max_requests
        # Layer-major: one layer's windows of every slot are one contiguous block.
        self.swa = torch.zeros(
            layout.swa_layers,
            max_requests,
            layout.sliding_window,
            layout.swa_record_bytes,
            dtype=torch.uint8,
            device=device,
        )
        self.compressor = torch.zeros(
            layout.compressor_sources,
            max_requests,
            layout.compressor_rows,
            layout.compressor_row_width,
            dtype=torch.float32,
            device=device,
        )
        self._free: deque[int] = deque(range(max_requests))
        self._slots: dict[Hashable, int] = {}

    @property
    def nbytes(self) -> int:
        return self.swa.numel() + self.compressor.numel() * self.compressor.element_size()

    def allocate(self, request_id: Hashable) -> int:
        """A zeroed slot for a new request (zeroed: a request never sees another's state)."""
        assert request_id not in self._slots, f"request {request_id!r} already has state"
        if not self._free:
            raise OutOfRequestSlots(f"all {self.max_requests} request state slots are in use")
        slot = self._free.popleft()
        self.swa[:, slot].zero_()
        self.compressor[:, slot].zero_()
        self._slots[request_id] = slot
        return slot

    def free(self, request_id: Hashable) -> None:
        self._free.append(self._slots.pop(request_id))

    def slot(self, request_id: Hashable) -> int:
        return self._slots[request_id]

    def swa_window(self, layer_idx: int, request_id: Hashable) -> torch.Tensor:
        """``uint8[sliding_window, swa_record_bytes]`` ring of one layer (a view)."""
        return self.swa[layer_idx, self._slots[request_id]]

    def compressor_state(self, source_idx: int, request_id: Hashable) -> torch.Tensor:
        """``float32[compressor_rows, row_width]`` open-group rows of one source (a view)."""
        return self.compressor[source_idx, self._slots[request_id]]
