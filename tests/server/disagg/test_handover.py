"""The handover header: round trip, and malformed values ignored rather than failing."""

from __future__ import annotations

import pytest

from server.disagg.handover import PREFILL_ROUTES, Handover, local_time, parse_arrival


def test_round_trip() -> None:
    h = Handover((4, 0, 7), 1795948721.25, (128, 0, 64))
    assert Handover.parse(h.header()) == h
    assert (h.pages_for(2), h.pages_for(3)) == (7, 0)  # a group the router did not report
    assert Handover.parse('{"pages": [2], "published_at": 5}') == Handover((2,), 5.0, ())


@pytest.mark.parametrize(
    ("pages", "prefill_hit", "restored", "cached"),
    [
        (4, 0, 256, 0),  # a new prompt: the prefill worker computed every restored page
        (4, 256, 256, 256),  # both workers had it: nothing computed, all cached
        (4, 128, 256, 128),  # the prefill worker computed pages 2 and 3
        (4, 128, 192, 128),  # the decode worker kept its last token's page to compute
        (4, 0, 384, 128),  # pages 4 and 5 were in the decode worker's own cache
        (0, 0, 192, 192),  # nothing published (a fallback): the decode worker's own hits
        (4, 0, 64, 0),  # a missing page cut the restore short
    ],
)
def test_cached_tokens_leave_out_what_the_prefill_worker_computed(
    pages: int, prefill_hit: int, restored: int, cached: int
) -> None:
    h = Handover((pages,), 0.0, (prefill_hit,))
    assert h.cached_tokens(0, restored, page_tokens=64) == cached


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "not json",
        "[]",
        '{"pages": [1]}',
        '{"pages": 3, "published_at": 1}',
        '{"pages": [-1], "published_at": 1}',
        '{"pages": ["x"], "published_at": 1}',
        '{"pages": [1], "published_at": "NaN"}',
        '{"pages": [1], "published_at": Infinity}',
        '{"pages": [1], "hit_tokens": [-5], "published_at": 1}',
        '{"pages": [1], "hit_tokens": 3, "published_at": 1}',
        '{"pages": [1e400], "published_at": 1}',  # int(inf): OverflowError
        '{"pages": [Infinity], "published_at": 1}',
        '{"pages": [' + "9" * 5000 + '], "published_at": 1}',  # past int-string limit
    ],
)
def test_a_malformed_header_is_no_handover(value: str | None) -> None:
    assert Handover.parse(value) is None


def test_each_prefill_route_is_served_by_a_prefill_worker() -> None:
    from fastapi import FastAPI

    from server.disagg.prefill_worker import add_prefill_routes

    app = FastAPI()

    async def no_auth() -> None:
        return None

    add_prefill_routes(app, ctx=None, auth=no_auth)  # type: ignore[arg-type]
    served = {route.path for route in app.routes}
    assert set(PREFILL_ROUTES.values()) == served - {"/openapi.json", "/docs", "/redoc"} - {
        "/docs/oauth2-redirect"
    }


def test_the_routers_arrival_on_this_hosts_monotonic_clock() -> None:
    # Wall 1000.0 here is monotonic 50.0: a router arrival at wall 996.5 is 46.5.
    assert parse_arrival("996.5", now_wall=1000.0, now_monotonic=50.0) == pytest.approx(46.5)
    assert parse_arrival("1003.0", now_wall=1000.0, now_monotonic=50.0) == 50.0  # skew: now
    for bad in (None, "", "soon", "nan", "inf"):
        assert parse_arrival(bad, now_wall=1000.0, now_monotonic=50.0) is None


def test_another_hosts_time_on_this_hosts_clock() -> None:
    assert local_time(996.5, now_wall=1000.0, now_monotonic=50.0) == pytest.approx(46.5)
    assert local_time(1003.0, now_wall=1000.0, now_monotonic=50.0) == 50.0
