"""Per-request cost, DeepSeek's way: three prices per million tokens, an off-peak window.

DeepSeek bills cache-hit input tokens, cache-miss input tokens and output
tokens (reasoning included) at three prices per million tokens, and has billed
a daily off-peak window in UTC (16:30-00:30) at a discount. A ``PriceTable``
holds the same: ``--prices HIT,MISS,OUTPUT`` with ``--off-peak-window`` and
``--off-peak-discount``, or ``--price-file`` (JSON, the same fields; see
``PriceTable.from_json``). A request is priced at the rates in force when it
arrived (wall clock, UTC). The window may wrap midnight; its start is inside
it, its end is not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from datetime import time as Time
from pathlib import Path
from typing import Any

PER_TOKENS = 1_000_000  # prices are per million tokens
KINDS = ("cache_hit_input", "cache_miss_input", "output")


@dataclass(frozen=True, slots=True)
class Rates:
    """Prices per million tokens."""

    cache_hit_input: float
    cache_miss_input: float
    output: float

    def __post_init__(self) -> None:
        for kind in KINDS:
            if not getattr(self, kind) >= 0:
                raise ValueError(f"prices: {kind} must be >= 0")

    def scaled(self, factor: float) -> Rates:
        return Rates(
            self.cache_hit_input * factor, self.cache_miss_input * factor, self.output * factor
        )


@dataclass(frozen=True, slots=True)
class Cost:
    """What one request cost, by kind; ``saved_by_cache``: what its cache-hit tokens
    would have cost more at the cache-miss price."""

    currency: str
    cache_hit_input: float
    cache_miss_input: float
    output: float
    saved_by_cache: float
    off_peak: bool

    @property
    def total(self) -> float:
        return self.cache_hit_input + self.cache_miss_input + self.output


@dataclass(frozen=True, slots=True)
class PriceTable:
    standard: Rates
    currency: str = "USD"
    off_peak_start: Time | None = None  # UTC; None = no off-peak window
    off_peak_end: Time | None = None
    off_peak_discount: float = 0.0  # fraction off every price, 0.5 = half price

    def __post_init__(self) -> None:
        if (self.off_peak_start is None) != (self.off_peak_end is None):
            raise ValueError("off-peak window: give both its start and its end")
        if self.off_peak_start is not None and self.off_peak_start == self.off_peak_end:
            raise ValueError("off-peak window: start and end must differ")
        if not 0 <= self.off_peak_discount <= 1:
            raise ValueError("off-peak discount: a fraction from 0 to 1")

    def is_off_peak(self, when: datetime) -> bool:
        if self.off_peak_start is None or self.off_peak_end is None:
            return False
        t = when.astimezone(UTC).time().replace(tzinfo=None)
        start, end = self.off_peak_start, self.off_peak_end
        if start < end:
            return start <= t < end
        return t >= start or t < end  # wraps midnight

    def rates_at(self, when: datetime) -> tuple[Rates, bool]:
        if self.is_off_peak(when):
            return self.standard.scaled(1 - self.off_peak_discount), True
        return self.standard, False

    def cost(
        self, *, hit_tokens: int, miss_tokens: int, output_tokens: int, when: datetime
    ) -> Cost:
        rates, off_peak = self.rates_at(when)
        return Cost(
            currency=self.currency,
            cache_hit_input=hit_tokens * rates.cache_hit_input / PER_TOKENS,
            cache_miss_input=miss_tokens * rates.cache_miss_input / PER_TOKENS,
            output=output_tokens * rates.output / PER_TOKENS,
            saved_by_cache=hit_tokens
            * (rates.cache_miss_input - rates.cache_hit_input)
            / PER_TOKENS,
            off_peak=off_peak,
        )

    # ------------------------------------------------------------ parsing
    @classmethod
    def from_flags(
        cls,
        prices: str,
        *,
        off_peak_window: str | None = None,
        off_peak_discount: float = 0.0,
        currency: str = "USD",
    ) -> PriceTable:
        """``prices``: "HIT,MISS,OUTPUT" per million tokens; ``off_peak_window``: "HH:MM-HH:MM"."""
        parts = prices.split(",")
        if len(parts) != 3:
            raise ValueError("--prices: three numbers, HIT,MISS,OUTPUT per million tokens")
        try:
            hit, miss, out = (float(p) for p in parts)
        except ValueError as exc:
            raise ValueError(f"--prices: {exc}") from None
        start, end = _window(off_peak_window) if off_peak_window else (None, None)
        return cls(Rates(hit, miss, out), currency, start, end, off_peak_discount)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PriceTable:
        """``{"currency": "USD", "cache_hit_input": 0.07, "cache_miss_input": 0.27,
        "output": 1.10, "off_peak": {"window": "16:30-00:30", "discount": 0.5}}``"""
        unknown = set(data) - {"currency", *KINDS, "off_peak"}
        if unknown:
            raise ValueError(f"price file: unknown fields {sorted(unknown)}")
        missing = [k for k in KINDS if k not in data]
        if missing:
            raise ValueError(f"price file: missing {missing}")
        rates = Rates(*(float(data[k]) for k in KINDS))
        off_peak = data.get("off_peak") or {}
        start, end = _window(off_peak["window"]) if "window" in off_peak else (None, None)
        return cls(
            rates,
            str(data.get("currency", "USD")),
            start,
            end,
            float(off_peak.get("discount", 0.0)),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> PriceTable:
        return cls.from_json(json.loads(Path(path).read_text()))


def _window(text: str) -> tuple[Time, Time]:
    try:
        start, end = text.split("-")
        return Time.fromisoformat(start.strip()), Time.fromisoformat(end.strip())
    except ValueError:
        raise ValueError(f"off-peak window {text!r}: expected HH:MM-HH:MM (UTC)") from None
