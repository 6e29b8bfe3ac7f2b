"""Per-request cost: hand-computed prices on both sides of the off-peak boundaries.

The table is DeepSeek's former deepseek-chat one: $0.07 cache hit, $0.27 cache
miss, $1.10 output per million tokens, half price from 16:30 to 00:30 UTC.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from datetime import time as Time

import pytest
from test_generation import FakeEngine, _call, _collect, _ctx

from server.openai.generation import Generation
from server.openai.pricing import PriceTable, Rates

TABLE = PriceTable.from_flags(
    "0.07,0.27,1.10", off_peak_window="16:30-00:30", off_peak_discount=0.5
)
TOKENS = {"hit_tokens": 1000, "miss_tokens": 3000, "output_tokens": 500}
# By hand: 1000 x 0.07 / 1e6, 3000 x 0.27 / 1e6, 500 x 1.10 / 1e6; saved 1000 x 0.20 / 1e6.
PEAK = (0.00007, 0.00081, 0.00055, 0.00143, 0.0002)
OFF_PEAK = (0.000035, 0.000405, 0.000275, 0.000715, 0.0001)


def at(hh: int, mm: int, ss: int = 0) -> datetime:
    return datetime(2026, 12, 1, hh, mm, ss, tzinfo=UTC)


@pytest.mark.parametrize(
    ("when", "expected", "off_peak"),
    [
        (at(16, 29, 59), PEAK, False),
        (at(16, 30), OFF_PEAK, True),  # the window's start is inside it
        (at(23, 59, 59), OFF_PEAK, True),
        (at(0, 0), OFF_PEAK, True),  # past midnight, still off-peak
        (at(0, 29, 59), OFF_PEAK, True),
        (at(0, 30), PEAK, False),  # the end is not
        (at(12, 0), PEAK, False),
    ],
)
def test_cost_on_both_sides_of_the_window(when: datetime, expected, off_peak: bool) -> None:
    cost = TABLE.cost(**TOKENS, when=when)
    got = (cost.cache_hit_input, cost.cache_miss_input, cost.output, cost.total)
    assert got == pytest.approx(expected[:4], rel=1e-12)
    assert cost.saved_by_cache == pytest.approx(expected[4], rel=1e-12)
    assert cost.off_peak is off_peak and cost.currency == "USD"


def test_other_time_zones_are_read_in_utc() -> None:
    from datetime import timedelta, timezone

    beijing = timezone(timedelta(hours=8))
    # 00:30 in Beijing is 16:30 UTC: off-peak starts.
    assert TABLE.is_off_peak(datetime(2026, 12, 2, 0, 30, tzinfo=beijing))
    assert not TABLE.is_off_peak(datetime(2026, 12, 2, 0, 29, tzinfo=beijing))


def test_a_window_within_one_day_and_no_window() -> None:
    table = PriceTable(
        Rates(1, 2, 3), off_peak_start=Time(1), off_peak_end=Time(5), off_peak_discount=0.25
    )
    assert not table.is_off_peak(at(0, 59)) and table.is_off_peak(at(1, 0))
    assert table.is_off_peak(at(4, 59)) and not table.is_off_peak(at(5, 0))
    cost = table.cost(hit_tokens=4, miss_tokens=0, output_tokens=2, when=at(2, 0))
    assert (cost.cache_hit_input, cost.output) == pytest.approx((3e-6, 4.5e-6), rel=1e-12)
    flat = PriceTable(Rates(1, 2, 3))
    assert not flat.is_off_peak(at(16, 30))


def test_price_file_and_bad_tables() -> None:
    table = PriceTable.from_json(
        {
            "currency": "CNY",
            "cache_hit_input": 0.2,
            "cache_miss_input": 1,
            "output": 2,
            "off_peak": {"window": "16:30-00:30", "discount": 0.5},
        }
    )
    assert table.currency == "CNY" and table.is_off_peak(at(17, 0))
    assert table.rates_at(at(17, 0))[0] == Rates(0.1, 0.5, 1.0)
    for bad in (
        {"cache_hit_input": 1, "cache_miss_input": 1},
        {"cache_hit_input": 1, "cache_miss_input": 1, "output": -1},
        {"cache_hit_input": 1, "cache_miss_input": 1, "output": 1, "extra": 1},
        {"cache_hit_input": 1, "cache_miss_input": 1, "output": 1, "off_peak": {"window": "9"}},
    ):
        with pytest.raises(ValueError):
            PriceTable.from_json(bad)
    with pytest.raises(ValueError):
        PriceTable.from_flags("1,2")
    with pytest.raises(ValueError):
        PriceTable.from_flags("1,2,3", off_peak_window="10:00-10:00")


@pytest.mark.parametrize(
    ("window", "inside", "outside"),
    [
        ("00:00Z-23:59Z", at(12, 0), at(23, 59, 30)),  # Z: already UTC
        ("16:30+00:00-00:30+00:00", at(16, 30), at(0, 30)),
        # 21:30-05:30 at +05:00 is 16:30-00:30 UTC, wrapping midnight.
        ("21:30+05:00-05:30+05:00", at(23, 0), at(12, 0)),
        ("11:30-05:00-19:30-05:00", at(16, 30), at(0, 30)),  # a negative offset
    ],
)
def test_windows_with_a_zone_are_read_in_utc(window: str, inside, outside) -> None:
    """A window written with Z or an offset used to pass start-up and then make
    every request a TypeError (naive vs aware times)."""
    table = PriceTable.from_flags("1,2,3", off_peak_window=window, off_peak_discount=0.5)
    assert table.off_peak_start is not None and table.off_peak_start.tzinfo is None
    assert table.is_off_peak(inside) and not table.is_off_peak(outside)
    cost = table.cost(hit_tokens=1, miss_tokens=1, output_tokens=1, when=inside)
    assert cost.off_peak and cost.total == pytest.approx(3e-6)


@pytest.mark.parametrize(
    "prices",
    ["5,1,3", "1,1,1e400", "nan,1,1", "1,inf,1", "1,2,-0.5", "1,2,1e10"],
)
def test_prices_that_could_fail_a_request_are_refused(prices: str) -> None:
    """A hit price above the miss price made every cache hit a 500 (a negative
    saved-by-cache into a counter); an infinite price gave a null cost and +Inf."""
    with pytest.raises(ValueError, match="prices"):
        PriceTable.from_flags(prices)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("off_peak", {"window": 5}),
        ("off_peak", "16:30-00:30"),
        ("off_peak", {"window": "16:30-00:30", "discount": None}),
        ("off_peak", {"window": "16:30-00:30", "rate": 0.5}),
        ("output", None),
        ("output", [1]),
        ("output", True),
        ("output", "1"),
        ("currency", {"code": "USD"}),
        ("currency", ""),
        ("currency", "DOLLARS-US"),
    ],
)
def test_bad_price_file_contents_are_value_errors(field: str, value: object) -> None:
    """Each used to raise AttributeError/TypeError past serve's handler, or (a dict
    currency) to be accepted as its repr."""
    data = {"cache_hit_input": 0.1, "cache_miss_input": 0.2, "output": 1.0, field: value}
    with pytest.raises(ValueError):
        PriceTable.from_json(data)


def test_a_price_file_that_is_not_an_object(tmp_path) -> None:
    for text in ("[1, 2, 3]", "{not json"):
        path = tmp_path / "prices.json"
        path.write_text(text)
        with pytest.raises(ValueError, match="price file"):
            PriceTable.from_file(path)


def test_usage_cost_and_counters_of_a_request() -> None:
    """10 prompt tokens (4 cached), 2 output tokens at 100 / 200 / 1000 per million,
    arriving off-peak (half price)."""

    async def main() -> None:
        engine = FakeEngine({"a": 4})
        engine.hold.set()
        ctx = _ctx(engine)
        ctx.settings.prices = PriceTable.from_flags(
            "100,200,1000", off_peak_window="16:30-00:30", off_peak_discount=0.5
        )
        gen = Generation(ctx, [_call("a", 0, 0, prompt=10)], wall_clock=lambda: at(23, 0))
        await _collect(gen)
        usage = gen.usage()
        await gen.close()
        cost = usage.cost
        assert cost is not None and cost.off_peak
        assert cost.cache_hit_input == pytest.approx(4 * 50 / 1e6, rel=1e-12)
        assert cost.cache_miss_input == pytest.approx(6 * 100 / 1e6, rel=1e-12)
        assert cost.output == pytest.approx(2 * 500 / 1e6, rel=1e-12)
        assert cost.total == pytest.approx(0.0018, rel=1e-12)
        body = usage.model_dump()
        assert body["cost"]["currency"] == "USD"
        text = ctx.metrics.render().decode()
        assert 'flashserve:cost_total{kind="output",model_name="m"} 0.001' in text
        assert 'flashserve:cost_saved_by_cache_total{model_name="m"} 0.0002' in text

    asyncio.run(main())


def test_no_prices_no_cost_field() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.hold.set()
        ctx = _ctx(engine)
        gen = Generation(ctx, [_call("a", 0, 0)])
        await _collect(gen)
        await gen.close()
        assert "cost" not in gen.usage().model_dump_json()

    asyncio.run(main())
