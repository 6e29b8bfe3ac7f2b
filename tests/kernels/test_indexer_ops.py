"""Indexer scores and block max: references against float64 loop oracles; the Triton
kernels (interpreted, in a child process) against the references. Seeds are fresh
each run and printed (``FLASHSERVE_TEST_SEED`` replays one).
"""

from __future__ import annotations

import math
import os
import secrets

import pytest
import torch
from interpreter import INTERPRETED, interpreted, run_triton_tests_in_child

from engine.model.deepseek_v41.indexer import indexer_scores as dense_indexer_scores
from kernels import dispatch
from kernels import indexer_ops as indexer_ops_module
from kernels.indexer_ops import (
    block_max,
    block_max_reference,
    indexer_scores,
    indexer_scores_at,
    indexer_scores_reference,
)
from kernels.kv_cache_ops import gather_index_keys_reference, store_kv_entries_reference
from kernels.kv_formats import dequantize_index_key


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("FLASHSERVE_TEST_SEED", secrets.randbits(31)))
    print(f"seed={value}")
    return value


# ----------------------------------------------------------------- inputs


def index_pages(g: torch.Generator, num_pages: int, entries: int) -> tuple[torch.Tensor, ...]:
    """(index_data [P, E, 64], index_scales [P, E, 4]) as strided views of wider page rows."""
    rows = torch.zeros(num_pages, entries * 68 + 24, dtype=torch.uint8)
    data = rows[:, 8 : 8 + entries * 64].unflatten(1, (entries, 64))
    scales = rows[:, 8 + entries * 64 : 8 + entries * 68].unflatten(1, (entries, 4))
    main = torch.zeros(num_pages, entries, 288, dtype=torch.uint8)
    n = num_pages * entries
    j = torch.arange(n)
    keys = torch.randn(n, 128, generator=g) * 2.0 ** torch.randint(-3, 4, (n, 1), generator=g)
    store_kv_entries_reference(
        main[..., :256],
        main[..., 256:],
        data,
        scales,
        j // entries,
        j % entries,
        torch.randn(n, 512, generator=g),
        keys,
    )
    return data, scales


def scoring_case(
    g: torch.Generator,
    rows: int,
    heads: int,
    num_pages: int,
    entries: int,
    n_cols: int,
    dtype: torch.dtype = torch.float32,
):
    """Rows over 2 sequences (rows of one sequence share a block table), ragged visibility."""
    data, scales = index_pages(g, num_pages, entries)
    max_pages = -(-n_cols // entries) + 1
    tables = torch.zeros(2, max_pages, dtype=torch.long)
    for s in range(2):
        used = min(num_pages, max_pages)
        tables[s, :used] = torch.randperm(num_pages, generator=g)[:used]
    seq_of_row = torch.randint(0, 2, (rows,), generator=g)
    block_tables = tables[seq_of_row]
    limit = min(n_cols, min(num_pages, max_pages) * entries)
    n_visible = torch.randint(0, limit + 1, (rows,), generator=g)
    n_visible[0] = 0
    n_visible[-1] = limit
    qi = torch.randn(rows, heads, 128, generator=g).to(dtype)
    w = torch.randn(rows, heads, generator=g) * heads**-0.5
    return qi, w, data, scales, block_tables, n_visible, n_cols


def oracle_scores(qi, w, data, scales, block_tables, n_visible, n_cols):
    """float64 by plain loops over rows, entries and heads.

    Also returns each score's magnitude ``sum_h |w| sum_d |q_d k_d|``: fp32 sums
    in any order are within a small multiple of eps times it.
    """
    entries = data.shape[1]
    out = torch.full((qi.shape[0], n_cols), -math.inf, dtype=torch.float64)
    mag = torch.zeros(qi.shape[0], n_cols, dtype=torch.float64)
    for t in range(qi.shape[0]):
        for s in range(int(n_visible[t])):
            page = int(block_tables[t, s // entries])
            rec = torch.cat((data[page, s % entries], scales[page, s % entries]))
            k = dequantize_index_key(rec).double()
            q = qi[t].double()
            out[t, s] = sum(float(w[t, h]) * max(0.0, float(q[h] @ k)) for h in range(qi.shape[1]))
            mag[t, s] = float(w[t].double().abs() @ (q.abs() @ k.abs()))
    return out, mag


def assert_scores_close(got: torch.Tensor, want: torch.Tensor, mag: torch.Tensor) -> None:
    """Same hidden (-inf) entries; elsewhere |got - want| <= 1e-5 (1 + magnitude)."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    shown = ~torch.isneginf(want)
    err = (got.double() - want.double()).abs()[shown]
    bound = 1e-5 * (1 + mag[shown])
    assert (err <= bound).all(), f"max err/bound {(err / bound).max():.3g}"


# ----------------------------------------------------------------- references


@pytest.mark.parametrize(
    ("rows", "heads", "num_pages", "entries", "n_cols"),
    [(5, 3, 4, 8, 30), (3, 4, 3, 4, 12), (4, 2, 2, 4, 11)],
)
def test_indexer_reference_matches_float64_oracle(
    seed, monkeypatch, rows, heads, num_pages, entries, n_cols
):
    # Small work sizes so the reference's row and column chunking is exercised.
    monkeypatch.setattr(indexer_ops_module, "_REFERENCE_ROWS", 2)
    monkeypatch.setattr(indexer_ops_module, "_REFERENCE_COLS", 5)
    case = scoring_case(
        torch.Generator().manual_seed(seed), rows, heads, num_pages, entries, n_cols
    )
    got = indexer_scores_reference(*case)
    assert got.dtype == torch.float32 and got.shape == (rows, n_cols)
    assert_scores_close(got, *oracle_scores(*case))


def test_indexer_reference_equals_model_dense_scores(seed):
    """A second code path: the model's ``indexer.indexer_scores`` over gathered keys."""
    qi, w, data, scales, block_tables, n_visible, n_cols = scoring_case(
        torch.Generator().manual_seed(seed), 4, 4, 3, 8, 20
    )
    got = indexer_scores_reference(qi, w, data, scales, block_tables, n_visible, n_cols)
    _, mag = oracle_scores(qi, w, data, scales, block_tables, n_visible, n_cols)
    want = torch.full_like(got, -math.inf)
    for t in range(4):
        n = int(n_visible[t])
        keys = gather_index_keys_reference(data, scales, block_tables[t], n)
        want[t, :n] = dense_indexer_scores(qi[t : t + 1], w[t : t + 1], keys)[0]
    assert_scores_close(got, want, mag)


def test_indexer_reference_float64_queries(seed):
    case = scoring_case(torch.Generator().manual_seed(seed), 3, 2, 2, 4, 9, torch.float64)
    got = indexer_scores_reference(*case)
    assert got.dtype == torch.float64
    want, mag = oracle_scores(*case)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    shown = ~torch.isneginf(want)
    assert ((got - want).abs()[shown] <= 1e-13 * (1 + mag[shown])).all()


@pytest.mark.parametrize("budget_rows", [1, 64])
def test_indexer_reference_rows_alone_on_their_tables(seed, monkeypatch, budget_rows):
    """Decode-like rows (one per table, ragged contexts): the batched page-block pass.

    ``budget_rows`` 1 makes every block one page wide, so rows drop out of the
    batch block by block as their contexts end.
    """
    monkeypatch.setattr(indexer_ops_module, "_REFERENCE_ROWS", budget_rows)
    monkeypatch.setattr(indexer_ops_module, "_REFERENCE_COLS", 4)
    g = torch.Generator().manual_seed(seed)
    rows, entries, num_pages, n_cols = 5, 4, 6, 21
    data, scales = index_pages(g, num_pages, entries)
    block_tables = torch.stack([torch.randperm(num_pages, generator=g) for _ in range(rows)])
    n_visible = torch.tensor([21, 0, 7, 13, 4])
    qi = torch.randn(rows, 3, 128, generator=g)
    w = torch.randn(rows, 3, generator=g)
    case = (qi, w, data, scales, block_tables, n_visible, n_cols)
    assert_scores_close(indexer_scores_reference(*case), *oracle_scores(*case))


def test_indexer_scores_at_equals_the_oracle_at_the_listed_entries(seed):
    qi, w, data, scales, block_tables, n_visible, n_cols = scoring_case(
        torch.Generator().manual_seed(seed), 4, 4, 3, 8, 20
    )
    want, mag = oracle_scores(qi, w, data, scales, block_tables, n_visible, n_cols)
    g = torch.Generator().manual_seed(seed + 1)
    entries = torch.full((4, 6), -1, dtype=torch.long)
    for t in range(4):
        n = int(n_visible[t])
        chosen = torch.randperm(n, generator=g)[: min(n, 5)].sort().values
        entries[t, : chosen.numel()] = chosen
    got = indexer_scores_at(qi, w, data, scales, block_tables, entries)
    assert got.shape == (4, 6) and got.dtype == torch.float32
    listed = entries >= 0
    assert torch.isneginf(got[~listed]).all()
    j = entries.clamp(min=0)
    err = (got.double() - want.gather(1, j)).abs()[listed]
    assert (err <= 1e-5 * (1 + mag.gather(1, j)[listed])).all()


def oracle_block_max(scores: torch.Tensor, block_size: int) -> list[list[float]]:
    rows, cols = scores.shape
    out = []
    for t in range(rows):
        row = scores[t].tolist()
        out.append(
            [max(row[b : b + block_size], default=-math.inf) for b in range(0, cols, block_size)]
        )
    return out


@pytest.mark.parametrize(("cols", "block_size"), [(17, 8), (16, 8), (5, 1), (9, 4), (0, 8), (3, 8)])
def test_block_max_reference_matches_loops(seed, cols, block_size):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(3, cols, generator=g)
    scores[0, : min(cols, 10)] = -math.inf  # hidden entries
    got = block_max_reference(scores, block_size)
    assert got.shape == (3, -(-cols // block_size))
    assert got.tolist() == oracle_block_max(scores, block_size)


# ----------------------------------------------------------------- Triton (interpreted)


@pytest.mark.skipif(INTERPRETED, reason="this process is the interpreter child")
def test_triton_kernels_interpreted():
    """This file's Triton tests, run in a TRITON_INTERPRET=1 child (triton is a dependency)."""
    run_triton_tests_in_child(__file__)


@interpreted
@pytest.mark.parametrize(
    ("rows", "heads", "num_pages", "entries", "n_cols", "dtype", "block_s"),
    [
        (4, 3, 4, 8, 30, torch.float32, 16),  # heads padded to 16, ragged column blocks
        (3, 32, 5, 4, 19, torch.float32, 16),  # the official 32 heads
        (2, 20, 3, 8, 24, torch.bfloat16, 16),  # heads padded to 32
        (3, 4, 6, 8, 40, torch.float32, 64),  # one column block wider than n_cols
    ],
)
def test_indexer_triton_equals_reference(
    seed, rows, heads, num_pages, entries, n_cols, dtype, block_s
):
    from kernels.triton.indexer_scores import indexer_scores_triton

    case = scoring_case(
        torch.Generator().manual_seed(seed), rows, heads, num_pages, entries, n_cols, dtype
    )
    out = torch.full((rows, n_cols), math.nan)
    got = indexer_scores_triton(*case, out=out, block_s=block_s)
    assert got is out and not torch.isnan(out).any()  # every element written
    want = indexer_scores_reference(*case)
    _, mag = oracle_scores(*case)
    assert_scores_close(out, want, mag)


@interpreted
@pytest.mark.parametrize(
    ("cols", "block_size", "dtype"),
    [
        (37, 8, torch.float32),
        (64, 8, torch.float32),
        (23, 5, torch.bfloat16),
        (7, 1, torch.float32),
    ],
)
def test_block_max_triton_equals_reference(seed, cols, block_size, dtype):
    from kernels.triton.block_max import block_max_triton

    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(3, cols, generator=g).to(dtype)
    scores[1, cols // 2 :] = -math.inf
    out = torch.full((3, -(-cols // block_size)), math.nan, dtype=dtype)
    got = block_max_triton(scores, block_size, out=out)
    assert got is out and not torch.isnan(out.float()).any()
    assert torch.equal(out, block_max_reference(scores, block_size))


@interpreted
def test_public_ops_dispatch_to_triton(seed, monkeypatch):
    from kernels.triton import block_max as block_max_triton_module
    from kernels.triton import indexer_scores as indexer_triton_module

    calls: list[str] = []
    for module, name in (
        (indexer_triton_module, "indexer_scores_triton"),
        (block_max_triton_module, "block_max_triton"),
    ):
        fn = getattr(module, name)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    case = scoring_case(torch.Generator().manual_seed(seed), 3, 4, 3, 8, 20)
    scores = indexer_scores(*case)
    blocks = block_max(scores, 8)
    assert calls == ["indexer_scores_triton", "block_max_triton"]
    assert_scores_close(scores, indexer_scores_reference(*case), oracle_scores(*case)[1])
    assert torch.equal(blocks, block_max_reference(scores, 8))
