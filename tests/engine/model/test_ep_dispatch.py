"""EP dispatch (engine/model/ep_dispatch.py): 2 gloo ranks, pairs to their experts' owners.

The oracles are built by hand here: rank r must receive, from each rank in rank
order, exactly that rank's (token, slot) pairs routed to r's experts, in expert
order (the row, its local expert id and its weight); each rank's output must
equal one process running all the experts over its rows (bitwise for packed
experts, whose CPU path computes each row on its own); and with stand-in
experts whose outputs span magnitudes, each token's sum must be the single
process's sum in expert order, to the bit. A rank with no rows still serves
the others' pairs.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest
import torch
import torch.distributed as dist
from parallel_helpers import free_port, join_gloo

from engine.model.deepseek_v41.routed_experts import RoutedExperts
from engine.model.ep_dispatch import ep_moe
from engine.model.parallel import Parallel, expert_range

E, K, DIM, INTER, LIMIT, WORLD = 6, 3, 32, 32, 7.0, 2
ROUNDS = ((5, 3), (4, 0))  # rows per rank; rank 1 idle in the second
MODES = ("unpacked", "packed", "scaled")  # scaled: the stand-in experts below
# The stand-in expert e's output is weight * row * SCALE[e]: sums of such terms
# round differently in another order (e.g. the per-rank partials an all-reduce adds).
SCALE = (1.0, 3.3e8, -3.3e8, 0.7, 1.1e-9, 5.0)
TIMEOUT_S = 120


def _experts(mode: str, first: int = 0, n: int = E) -> RoutedExperts:
    """Experts ``[first, first + n)`` of one seeded float64 layer."""
    torch.manual_seed(0)
    whole = RoutedExperts(E, DIM, INTER, LIMIT).double()
    part = RoutedExperts(n, DIM, INTER, LIMIT, first=first, total=E).double()
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(part, name).copy_(getattr(whole, name)[first : first + n])
    return part.packed_copy() if mode == "packed" else part


def _scaled(row: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    return weight * row * torch.tensor(SCALE, dtype=row.dtype)[expert].unsqueeze(-1)


def _inputs(rank: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows, routing weights and k distinct experts per row (seeded)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(rows, DIM, generator=g, dtype=torch.float64)
    idx = torch.rand(rows, E, generator=g).argsort(dim=-1)[:, :K]
    return x, torch.rand(rows, K, generator=g, dtype=torch.float64), idx


def _rank(rank: int, port: int, out: mp.Queue) -> None:
    try:
        join_gloo(rank, WORLD, port)
        p = Parallel(ep_rank=rank, ep_size=WORLD, ep_dispatch=True)
        first, stop = p.experts(E)
        results = []
        for mode in MODES:
            experts = _experts(mode, first, stop - first)
            seen: list[tuple[torch.Tensor, ...]] = []
            served = experts.per_pair

            def spy(rows, weight, local, served=served, seen=seen, mode=mode):
                seen.append((rows.clone(), weight.clone(), local.clone()))
                if mode == "scaled":
                    return _scaled(rows, weight, local + first)
                return served(rows, weight, local)

            experts.per_pair = spy
            for counts in ROUNDS:
                y = ep_moe(experts, p, *_inputs(rank, counts[rank]))
                # numpy: pickled by value, not through shared memory that dies with the rank
                arrays = [t.numpy() for t in (y, *seen.pop())]
                results.append((mode, counts, *arrays))
        out.put((rank, results))
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def ranks():
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = {}
    try:
        while len(got) < WORLD:  # a failed rank reports at once; the other may be stuck
            rank, result = out.get(timeout=TIMEOUT_S)
            assert not isinstance(result, str), f"rank {rank} failed:\n{result}"
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=30 if len(got) == WORLD else 0)
            if p.is_alive():
                p.kill()
    return got


def _expected_received(rank: int, counts: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Rows, weights [P, 1] and local ids of the pairs routed to ``rank``'s experts."""
    first, stop = expert_range(E, rank, WORLD)
    rows, weights, local = [], [], []
    for source in range(WORLD):
        x, w, idx = _inputs(source, counts[source])
        for e in range(first, stop):  # the source's pairs in expert order, tokens ascending
            for t, slot in (idx == e).nonzero().tolist():
                rows.append(x[t])
                weights.append(w[t, slot])
                local.append(e - first)
    return torch.stack(rows), torch.stack(weights).unsqueeze(-1), torch.tensor(local)


def test_each_rank_receives_exactly_the_pairs_routed_to_its_experts(ranks):
    for rank, results in ranks.items():
        for mode, counts, _, *received in results:
            rows, weights, local = map(torch.from_numpy, received)
            want_rows, want_weights, want_local = _expected_received(rank, counts)
            assert rows.shape[0] == want_rows.shape[0] > 0, (rank, counts, mode)
            assert torch.equal(rows, want_rows)
            assert torch.equal(weights, want_weights)
            assert torch.equal(local, want_local)


def _summed_in_expert_order(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in idx[t].argsort().tolist():  # ascending expert id, from zero
            y[t] = y[t] + _scaled(x[t : t + 1], w[t, slot], idx[t, slot : slot + 1])[0]
    return y


def test_each_rank_gets_one_process_outputs_of_its_rows(ranks):
    single = {mode: _experts(mode) for mode in ("unpacked", "packed")}
    for rank, results in ranks.items():
        for mode, counts, y, *_ in results:
            y = torch.from_numpy(y)
            x, weights, idx = _inputs(rank, counts[rank])
            if mode == "scaled":
                assert torch.equal(y, _summed_in_expert_order(x, weights, idx)), (rank, counts)
                continue
            want = single[mode](x, weights, idx)
            assert y.shape == (counts[rank], DIM) and y.dtype == want.dtype
            if mode == "packed":
                assert torch.equal(y, want), (rank, counts)
            else:
                torch.testing.assert_close(y, want, atol=1e-12, rtol=0)
