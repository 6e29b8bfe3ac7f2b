"""Independent float64 numpy oracles of the E2M1 and E4M3 grids (round half to even),
shared by the KV-record and weight-format tests."""

from __future__ import annotations

import numpy as np

GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3 = np.array(
    [
        (b & 7) / 8 * 2.0**-6 if b >> 3 == 0 else (1 + (b & 7) / 8) * 2.0 ** ((b >> 3) - 7)
        for b in range(0x7F)
    ]
)


def nearest_even(mag: np.ndarray, table: np.ndarray) -> np.ndarray:
    d = np.abs(mag[..., None] - table)
    tied = d == d.min(-1, keepdims=True)
    even = tied & (np.arange(len(table)) % 2 == 0)
    return np.where(even.any(-1), even.argmax(-1), tied.argmax(-1))


def o_e2m1(v):
    return nearest_even(np.abs(v), GRID) | (np.signbit(v).astype(np.int64) << 3)


def o_e4m3(v):
    return nearest_even(np.minimum(np.abs(v), 448.0), E4M3) | (np.signbit(v).astype(np.int64) << 7)
