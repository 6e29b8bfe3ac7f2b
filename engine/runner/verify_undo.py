"""Undo of a verify step's dropped rows in the per-request state (SWA rings, compressor rows).

A verify step runs a sequence's last token and its ``k`` drafts as one chunk of
``k + 1`` rows; the engine then keeps the rows up to the first rejected draft.
Global KV needs no undo: an entry a dropped row completed sits past
``num_computed`` in a page that is not full, so it is never committed or hashed,
and the row that completes the entry for real rewrites it. The request state is
different: the chunk wrote its rows into the SWA ring (slot ``p % W``), over the
records of positions ``p - W`` that the next rows' windows still read, and it left
the compressor's open-group rows as of the chunk's end.

So while the chunk runs, the backend saves what it overwrites (``VerifyUndo``: the
ring slots' old records; the compressor rows of the open group plus the chunk's
own rows), and before the sequence runs again the runner puts back the part
past ``num_computed``. Nothing is saved for a plain decode or a prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore.request_state import RequestStatePool


@dataclass(slots=True)
class VerifyUndo:
    """What one verify chunk over rows ``[start, end)`` of a sequence overwrote."""

    start: int
    end: int
    # SWA layer -> the ring's records of slots ``p % W`` for p in [start, end), before.
    swa: dict[int, torch.Tensor] = field(default_factory=dict)
    # compressor state index -> (ratio, first, rows): the raw rows of positions
    # [first, end), ``first`` the start of the group open when the chunk began.
    groups: dict[int, tuple[int, int, torch.Tensor]] = field(default_factory=dict)

    def rollback(self, states: RequestStatePool, seq_id: int, kept: int) -> None:
        """Make ``seq_id``'s state what rows ``[start, kept)`` alone would have left."""
        if kept >= self.end:
            return
        assert self.start < kept, "the row of the last committed token is always kept"
        for layer, saved in self.swa.items():
            ring = states.swa_window(layer, seq_id)
            pos = torch.arange(kept, self.end, device=ring.device)
            ring[pos % ring.shape[0]] = saved[kept - self.start :]
        for index, (ratio, first, rows) in self.groups.items():
            # The group open at ``kept``: its rows so far, from the chunk's or the
            # open group's rows (the later ones the chunk's end left are dropped).
            lo = kept - kept % ratio
            state = states.compressor_state(index, seq_id)
            state[: kept - lo] = rows[lo - first : kept - first]
