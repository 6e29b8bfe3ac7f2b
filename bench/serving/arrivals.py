"""When sessions start: Gamma-distributed gaps at a mean request rate (vLLM's convention).

A gap ~ Gamma(shape = burstiness, scale = 1 / (rate * burstiness)) has mean
1 / rate whatever the burstiness; burstiness 1 is a Poisson process, below 1
burstier, above 1 more regular. An infinite rate sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the benchmark start at which each of ``n`` sessions starts.

    The first gap is drawn too (vLLM sleeps before the first request as well);
    offsets are cumulative, so the driver sleeps until ``start + offset`` and
    a slow client does not stretch the schedule.
    """
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (inf = all at once), got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps).tolist()
