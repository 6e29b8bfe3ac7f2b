"""The handover header: round trip, and malformed values ignored rather than failing."""

from __future__ import annotations

import pytest

from server.handover import PREFILL_ROUTES, Handover


def test_round_trip() -> None:
    h = Handover((4, 0, 7), 1795948721.25)
    assert Handover.parse(h.header()) == h
    assert (h.pages_for(2), h.pages_for(3)) == (7, 0)  # a group the router did not report


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
    ],
)
def test_a_malformed_header_is_no_handover(value: str | None) -> None:
    assert Handover.parse(value) is None


def test_each_prefill_route_is_served_by_a_prefill_worker() -> None:
    from fastapi import FastAPI

    from server.prefill_worker import add_prefill_routes

    app = FastAPI()

    async def no_auth() -> None:
        return None

    add_prefill_routes(app, ctx=None, auth=no_auth)  # type: ignore[arg-type]
    served = {route.path for route in app.routes}
    assert set(PREFILL_ROUTES.values()) == served - {"/openapi.json", "/docs", "/redoc"} - {
        "/docs/oauth2-redirect"
    }
