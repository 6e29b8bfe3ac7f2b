"""Per-request cost, DeepSeek's way: three prices per million tokens, an off-peak window.

DeepSeek bills cache-hit input tokens, cache-miss input tokens and output
tokens (reasoning included) at three prices per million tokens, and has billed
a daily off-peak window in UTC (16:30-00:30) at a discount. A ``PriceTable``
holds the same: ``--prices HIT,MISS,OUTPUT`` with ``--off-peak-window`` and
``--off-peak-discount``, or ``--price-file`` (JSON, the same fields; see
``PriceTable.from_json``). A request is priced at the rates in force when it
arrived (wall clock, UTC). The window may wrap midnight; its start is inside
it, its end is not. A window written with ``Z`` or an offset (``16:30+08:00``)
is read in that zone and kept in UTC.

Every check happens when the table is built (``flashserve serve`` refuses bad
settings before loading, with one line): prices finite and non-negative, the
cache-hit price at most the cache-miss one (a hit never costs more than the
work it saves), a short currency code. Pricing a request then cannot raise, and
no metric receives a negative or non-finite amount.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime
from datetime import time as Time
from pathlib import Path
from typing import Any

PER_TOKENS = 1_000_000  # prices are per million tokens
KINDS = ("cache_hit_input", "cache_miss_input", "output")
MAX_CURRENCY_CHARS = 8  # "USD", "CNY", "credits"
# Far above any real price, low enough that a price times any token count stays finite.
MAX_PRICE = 1e9
_TIME = r"(\d{1,2}:\d{2}(?::\d{2})?(?:Z|[+-]\d{2}:?\d{2})?)"
_WINDOW = re.compile(rf"{_TIME}\s*-\s*{_TIME}")


@dataclass(frozen=True, slots=True)
class Rates:
    """Prices per million tokens."""

    cache_hit_input: float
    cache_miss_input: float
    output: float

    def __post_init__(self) -> None:
        for kind in KINDS:
            price = getattr(self, kind)
            if not (math.isfinite(price) and 0 <= price <= MAX_PRICE):
                raise ValueError(f"prices: {kind} must be from 0 to {MAX_PRICE:g}, not {price}")
        if self.cache_hit_input > self.cache_miss_input:
            raise ValueError(
                "prices: cache_hit_input must not exceed cache_miss_input "
                f"({self.cache_hit_input} > {self.cache_miss_input})"
            )

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
        if not (0 < len(self.currency) <= MAX_CURRENCY_CHARS and self.currency.isprintable()):
            raise ValueError(
                f"currency: a short code of 1 to {MAX_CURRENCY_CHARS} characters, "
                f"not {self.currency!r}"
            )
        if (self.off_peak_start is None) != (self.off_peak_end is None):
            raise ValueError("off-peak window: give both its start and its end")
        if self.off_peak_start is not None and self.off_peak_start == self.off_peak_end:
            raise ValueError("off-peak window: start and end must differ")
        if not 0 <= self.off_peak_discount <= 1:  # also refuses NaN
            raise ValueError("off-peak discount: a fraction from 0 to 1")

    def is_off_peak(self, when: datetime) -> bool:
        if self.off_peak_start is None or self.off_peak_end is None:
            return False
        t = when.astimezone(UTC).time()
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
        rates = Rates(*(_number(data[k], f"price file: {k}") for k in KINDS))
        currency = data.get("currency", "USD")
        if not isinstance(currency, str):
            raise ValueError(f"price file: currency must be a string, not {currency!r}")
        off_peak = data.get("off_peak") or {}
        if not isinstance(off_peak, dict):
            raise ValueError(
                'price file: off_peak must be {"window": "HH:MM-HH:MM", "discount": x}'
            )
        unknown = set(off_peak) - {"window", "discount"}
        if unknown:
            raise ValueError(f"price file: unknown off_peak fields {sorted(unknown)}")
        window = off_peak.get("window")
        if window is not None and not isinstance(window, str):
            raise ValueError(f'price file: off_peak window must be "HH:MM-HH:MM", not {window!r}')
        start, end = _window(window) if window else (None, None)
        discount = _number(off_peak.get("discount", 0.0), "price file: off_peak discount")
        return cls(rates, currency, start, end, discount)

    @classmethod
    def from_file(cls, path: str | Path) -> PriceTable:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"price file {path}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"price file {path}: a JSON object of prices")
        return cls.from_json(data)


def _number(value: object, what: str) -> float:
    """A JSON number as a float (``true`` and strings are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what}: a number, not {value!r}")
    return float(value)


def _window(text: str) -> tuple[Time, Time]:
    """``HH:MM-HH:MM`` in UTC; either end may carry ``Z`` or an offset (``+05:00``,
    ``-05:00``), so the separator is found by the shape of a time, not the first ``-``."""
    match = _WINDOW.fullmatch(text.strip())
    try:
        if match is None:
            raise ValueError
        return _utc_time(match[1]), _utc_time(match[2])
    except ValueError:
        raise ValueError(f"off-peak window {text!r}: expected HH:MM-HH:MM (UTC)") from None


def _utc_time(text: str) -> Time:
    """A time of day as a naive UTC time; an offset is applied on a fixed day, so
    ``01:00+05:00`` is 20:00 UTC."""
    t = Time.fromisoformat(text.strip())
    if t.tzinfo is None:
        return t
    return datetime.combine(date(2000, 1, 3), t).astimezone(UTC).time().replace(tzinfo=None)
