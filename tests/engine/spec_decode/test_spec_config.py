"""``--speculative-config``'s JSON: what it accepts and the message for what it refuses."""

from __future__ import annotations

import pytest

from engine.spec_decode.config import SpeculativeConfig


def test_min_confidence_is_a_dspark_key_in_zero_one() -> None:
    spec = SpeculativeConfig.parse(
        '{"method": "dspark", "num_speculative_tokens": 4, "min_confidence": 0.25}'
    )
    assert spec == SpeculativeConfig("dspark", 4, min_confidence=0.25)
    assert (
        SpeculativeConfig.parse('{"method": "dspark", "num_speculative_tokens": 2}').min_confidence
        is None
    )


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "min_confidence": 0.5}',
            "'dspark' only",
        ),
        ('{"method": "dspark", "num_speculative_tokens": 4, "min_confidence": 1.5}', "in [0, 1]"),
        ('{"method": "dspark", "num_speculative_tokens": 4, "min_confidence": -0.1}', "in [0, 1]"),
        ('{"method": "dspark", "num_speculative_tokens": 4, "min_confidence": "high"}', "a number"),
        ('{"method": "dspark", "num_speculative_tokens": 4, "min_confidence": true}', "a number"),
    ],
)
def test_bad_min_confidence_is_refused_by_name(body: str, words: str) -> None:
    with pytest.raises(ValueError, match="min_confidence") as info:
        SpeculativeConfig.parse(body)
    assert words in str(info.value)
