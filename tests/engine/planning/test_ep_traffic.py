"""EP dispatch/combine bytes per token per MoE layer, against hand figures and a count."""

from __future__ import annotations

from fractions import Fraction
from itertools import combinations

import pytest

from engine.model.deepseek_v41.config import ModelConfig
from engine.planning.ep_traffic import ep_traffic, ep_traffic_of


def test_official_on_8_and_16_ranks_matches_the_hand_computation() -> None:
    c = ModelConfig.official()  # H 5120, top-6 of 384 experts
    eight = ep_traffic_of(c, 8)
    assert (eight.experts_per_rank, eight.local_fraction) == (48, 1 / 8)
    assert eight.remote_copies == 6 * 7 / 8 == 5.25
    assert eight.dispatch_row_fp8 == 5120 + 160  # E4M3 row + one UE8M0 per 32
    assert eight.dispatch_fp8 == 5.25 * 5280 == 27_720
    assert eight.dispatch_bf16 == eight.combine_bf16 == 5.25 * 10_240 == 53_760
    assert eight.inter_node_copies == 0 and eight.inter_node_bytes == 0

    sixteen = ep_traffic_of(c, 16, nnodes=2)
    assert sixteen.remote_copies == 6 * 15 / 16 == 5.625
    assert sixteen.dispatch_fp8 == 29_700 and sixteen.combine_bf16 == 57_600
    assert sixteen.inter_node_copies == 3  # half the experts live on the other node
    assert sixteen.inter_node_bytes == 3 * (5280 + 10_240) == 46_560

    # Distinct remote ranks: P(a given other rank owns none of the 6) as a product.
    for t, per in ((eight, 48), (sixteen, 24)):
        none = Fraction(1)
        for i in range(6):
            none *= Fraction(384 - per - i, 384 - i)
        assert t.remote_ranks == pytest.approx(float((t.world - 1) * (1 - none)), rel=1e-12)
    assert 3.87 < eight.remote_ranks < 3.88 and 4.84 < sixteen.remote_ranks < 4.85


def test_remote_ranks_equals_an_enumeration_of_every_routing() -> None:
    """8 experts on 4 ranks (2 each), top-3, token on rank 0: count over all C(8, 3) choices."""
    owner = [e // 2 for e in range(8)]
    choices = list(combinations(range(8), 3))
    ranks = sum(len({owner[e] for e in pick} - {0}) for pick in choices) / len(choices)
    copies = sum(sum(owner[e] != 0 for e in pick) for pick in choices) / len(choices)
    t = ep_traffic(hidden_size=64, n_experts=8, top_k=3, world=4)
    assert t.remote_ranks == pytest.approx(ranks, rel=1e-12)
    assert t.remote_copies == pytest.approx(copies, rel=1e-12)
    assert t.dispatch_fp8_per_rank == pytest.approx(ranks * (64 + 2))


@pytest.mark.parametrize(
    ("world", "nnodes", "experts"), [(5, 1, 384), (16, 3, 384), (8, 1, 100), (0, 1, 8)]
)
def test_uneven_splits_are_refused(world: int, nnodes: int, experts: int) -> None:
    with pytest.raises(ValueError):
        ep_traffic(hidden_size=5120, n_experts=experts, top_k=6, world=world, nnodes=nnodes)


def test_sent_and_all_gather_bytes_match_the_hand_computation() -> None:
    """What engine/model/ep_dispatch.py sends (per remote pair: a bf16 row, fp32 id and
    weight out, an fp32 output back) against the former all-gather + fp32 all-reduce."""
    c = ModelConfig.official()  # H 5120, top-6
    eight, two = ep_traffic_of(c, 8), ep_traffic_of(c, 2)
    assert eight.sent_dispatch_row == 10_240 + 8 and eight.sent_combine_row == 20_480
    assert eight.sent_bytes == 5.25 * (10_248 + 20_480) == 161_322
    # all-gather: the row and 6 (weight, id) fp32 pairs to 7 others; ring all-reduce of
    # 8 ranks' fp32 rows, 2 x 7/8 of them per rank, i.e. 2 x 7 rows per own token.
    assert eight.gather_row == 10_240 + 48
    assert eight.gather_bytes == 7 * 10_288 + 14 * 20_480 == 358_736
    # At 2 ranks the gather sends fewer bytes: 3 remote pairs each way vs 1 row + 2 sums.
    assert two.sent_bytes == 3 * 30_728 > two.gather_bytes == 10_288 + 2 * 20_480
