from __future__ import annotations

import torch

from engine.model.deepseek_v41.candidates import (
    candidate_block_mask,
    mask_columns,
    select_topk,
    select_topk_among,
    visible_entries,
)

INF = float("inf")


def _mask(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r] for r in rows])


def test_visible_entries_hand_cases():
    pos = torch.tensor([0, 1, 2, 3, 6])
    # ratio 2: entry j complete once token 2j+1 is seen.
    assert visible_entries(pos, 4, 2).int().tolist() == [
        [0, 0, 0, 0],
        [1, 0, 0, 0],
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
    ]
    # ratio 1: entry j visible at pos >= j (the current token's own entry included).
    assert visible_entries(pos, 5, 1).int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ]


def test_select_topk_picks_best_visible_sorted_ascending():
    scores = torch.tensor([[0.5, 3.0, -1.0, 2.0, 9.0, 1.0]])
    visible = _mask(["111101"])  # entry 4 (score 9) is not visible
    assert select_topk(scores, visible, 3).tolist() == [[1, 3, 5]]  # scores 3, 2, 1
    assert select_topk(scores, visible, 1).tolist() == [[1]]


def test_select_topk_pads_when_fewer_visible_than_k():
    scores = torch.tensor([[5.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    visible = _mask(["0110", "0000", "1111"])
    got = select_topk(scores, visible, 3)
    assert got.tolist() == [[1, 2, -1], [-1, -1, -1], [1, 2, 3]]
    # k larger than the number of entries: every visible entry, then -1s.
    assert select_topk(scores, visible, 6).tolist() == [
        [1, 2, -1, -1, -1, -1],
        [-1, -1, -1, -1, -1, -1],
        [0, 1, 2, 3, -1, -1],
    ]
    assert got.dtype == torch.long


def test_select_topk_ties_go_to_lower_index():
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    assert select_topk(scores, _mask(["11111"]), 2).tolist() == [[1, 2]]
    assert select_topk(scores, _mask(["10011"]), 2).tolist() == [[0, 3]]
    # A visible -inf entry still outranks any invisible one.
    scores = torch.tensor([[-INF, 7.0, -INF]])
    assert select_topk(scores, _mask(["001"]), 2).tolist() == [[2, -1]]


def test_candidate_blocks_keep_best_and_newest():
    # 4 blocks of 2 entries; 7 entries visible (0..6); keep 2 blocks.
    scores = torch.tensor([[9.0, 0.0, 1.0, 8.5, 2.0, 3.0, -5.0, 100.0]])
    visible = _mask(["11111110"])
    # Block maxima over visible entries: [9, 8.5, 3, -5 (entry 7 hidden)];
    # block 3 holds the newest visible entry (6) -> +inf; then block 0 (9).
    got = candidate_block_mask(scores, visible, block_size=2, topk_blocks=2)
    assert got.int().tolist() == [[1, 1, 0, 0, 0, 0, 1, 0]]
    # With three blocks: block 1 (8.5) joins.
    got = candidate_block_mask(scores, visible, block_size=2, topk_blocks=3)
    assert got.int().tolist() == [[1, 1, 1, 1, 0, 0, 1, 0]]


def test_candidate_blocks_newest_block_is_kept_even_when_it_scores_worst():
    scores = torch.tensor([[5.0, 5.0, 4.0, 4.0, -100.0]])
    visible = _mask(["11111"])
    got = candidate_block_mask(scores, visible, block_size=2, topk_blocks=1)
    assert got.int().tolist() == [[0, 0, 0, 0, 1]]  # the ragged last block, alone


def test_candidate_blocks_are_a_no_op_with_few_visible_entries():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 40, generator=g)
    pos = torch.tensor([0, 5, 15, 31, 47, 79])
    visible = visible_entries(pos, 40, 2)  # at most 40 visible <= 5 blocks of 8
    assert torch.equal(candidate_block_mask(scores, visible, 8, 5), visible)
    # Fewer kept blocks than spanned: a strict subset, always holding the newest entry.
    got = candidate_block_mask(scores, visible, 8, 2)
    assert torch.equal(got & ~visible, torch.zeros_like(got))
    assert got[-1].sum() <= 16 and bool(got[-1, 39])


def test_candidate_blocks_skip_blocks_without_visible_entries_and_ties():
    # Only block 1 has visible entries: nothing else is kept even with room for 3 blocks.
    scores = torch.zeros(1, 6)
    got = candidate_block_mask(scores, _mask(["001100"]), block_size=2, topk_blocks=3)
    assert got.int().tolist() == [[0, 0, 1, 1, 0, 0]]
    # Equal block scores: the lower block wins the last slot (block 3 is newest).
    scores = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    got = candidate_block_mask(scores, _mask(["11111111"]), block_size=2, topk_blocks=2)
    assert got.int().tolist() == [[1, 1, 0, 0, 0, 0, 1, 1]]
    # A row with nothing visible keeps nothing.
    got = candidate_block_mask(torch.zeros(1, 4), _mask(["0000"]), block_size=2, topk_blocks=2)
    assert not got.any()


def test_select_topk_equals_a_python_sort_oracle_with_many_ties():
    """Random integer scores (many ties), random visibility: the tie and padding
    rules against a plain Python sort on (eligible, score, -index)."""
    g = torch.Generator().manual_seed(5)
    for k in (1, 3, 8, 40):
        scores = torch.randint(-3, 4, (20, 30), generator=g).float()
        scores[0, :5] = float("-inf")  # eligible -inf still beats ineligible
        visible = torch.rand(20, 30, generator=g) < 0.6
        got = select_topk(scores, visible, k)
        for t in range(20):
            ranked = sorted(
                range(30), key=lambda s: (not bool(visible[t, s]), -float(scores[t, s]), s)
            )
            picks = sorted(s for s in ranked[:k] if visible[t, s])
            expected = picks + [-1] * (k - len(picks))
            assert got[t].tolist() == expected


def test_mask_columns_lists_true_columns_ascending():
    mask = torch.tensor([[False, True, False, True], [False] * 4, [True, True, True, False]])
    assert mask_columns(mask, 3).tolist() == [[1, 3, -1], [-1, -1, -1], [0, 1, 2]]


def test_select_topk_among_equals_select_topk_over_the_allowed_dense_row():
    """A Reindex layer scores only its candidates: same picks as the dense row with
    everything else disallowed, ties included (integer scores make many)."""
    g = torch.Generator().manual_seed(7)
    scores = torch.randint(0, 4, (6, 40), generator=g).float()
    allowed = torch.rand(6, 40, generator=g) < 0.3
    allowed[0] = False  # a row with no candidate
    entries = mask_columns(allowed, 40)
    compact = scores.gather(1, entries.clamp(min=0)).masked_fill(entries < 0, float("-inf"))
    for k in (1, 3, 16):
        assert torch.equal(select_topk_among(compact, entries, k), select_topk(scores, allowed, k))
