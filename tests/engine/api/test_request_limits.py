"""``output_budget``: the one rule every front end sizes ``max_tokens`` with.

Oracle: hand-computed room (context minus prompt), and ``RequestLimits.validate``
(the engine's own admission check) agreeing on which prompts leave no room.
"""

from __future__ import annotations

import pytest

from engine.api.errors import RequestError
from engine.api.request import Request
from engine.api.request_limits import RequestLimits, output_budget

LIMITS = RequestLimits(
    vocab_size=100, max_model_len=1000, page_tokens=64, num_pages=64, has_tokenizer=False
)


@pytest.mark.parametrize(
    ("requested", "prompt", "default", "expected"),
    [
        (None, 100, None, 900),  # no budget asked: the whole room
        (None, 100, 64, 64),  # the server's default, when it fits
        (None, 990, 64, 10),  # ... clamped like any other
        (900, 100, None, 900),  # exactly the room
        (901, 100, None, 900),  # one past it: clamped, not refused
        (32000, 999, 8, 1),  # an agent's fixed 32K on a nearly full context
        (5, 100, 64, 5),  # a request's own budget wins over the default
    ],
)
def test_budget_is_the_request_clamped_to_the_room(
    requested: int | None, prompt: int, default: int | None, expected: int
) -> None:
    assert output_budget(requested, prompt, 1000, default) == expected


@pytest.mark.parametrize("prompt", [1000, 1001, 5000])
def test_a_prompt_that_fills_the_context_is_refused_as_the_engine_refuses_it(prompt: int) -> None:
    with pytest.raises(RequestError) as info:
        output_budget(1, prompt, 1000)
    assert info.value.param == "prompt_token_ids"
    with pytest.raises(RequestError) as engine_info:
        LIMITS.validate(Request("r", [1] * prompt))
    assert engine_info.value.param == info.value.param


def test_the_engine_admits_every_prompt_the_budget_gives_room() -> None:
    LIMITS.validate(Request("r", [1] * 999))
    assert output_budget(None, 999, 1000) == 1
