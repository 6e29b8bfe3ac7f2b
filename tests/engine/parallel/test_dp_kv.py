"""DP attention's KV bookkeeping (engine/parallel/dp_kv.py) and the scheduler over it, no model.

Placement rules checked on hand-built cases: a prompt whose prefix is cached
on one rank goes there even when that rank is busier; without a hit the
least-loaded rank takes it; a rank that cannot hold the pages is passed over
even with the hit. Preemption frees pages on the rank that needs them.
"""

from __future__ import annotations

from engine_helpers import TINY

from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.parallel.dp_kv import DataParallelKV
from kvstore.device.layout import kv_layout

PT = 8


def make_dp(pages_per_rank: int, ranks: int = 2) -> DataParallelKV:
    layout = kv_layout(TINY.kv_source_layer_ids, TINY.compress_ratios, PT, "fp4")
    return DataParallelKV(layout, pages_per_rank * layout.page_bytes, ranks)


def tokens(n: int, base: int) -> list[int]:
    return [(base + 3 * i) % 97 + 3 for i in range(n)]


def admit(kv: DataParallelKV, rid: int, ids: list[int]) -> int:
    rank = kv.place(rid, ids, b"")
    kv.plan_restore(rid, ids, b"")
    kv.allocate(rid, len(ids))
    return rank


def test_the_cached_prefix_wins_over_load_and_capacity_wins_over_the_prefix():
    kv = make_dp(pages_per_rank=10)
    a = tokens(3 * PT + 1, 0)
    assert admit(kv, 1, a) == 0  # a tie everywhere: the first rank
    kv.commit_full_pages(1, a[: 3 * PT], b"")  # a's 3 full pages cached on rank 0
    assert admit(kv, 2, tokens(PT, 50)) == 1  # no hit: the idle rank
    assert admit(kv, 3, a[:PT] + tokens(3, 60)) == 0  # a 1-page hit beats rank 1's lighter load
    # Rank 0 now runs 2 sequences, rank 1 one: the 3-page hit still decides.
    c = a[: 3 * PT] + tokens(5, 70)
    assert kv.place(4, c, b"") == 0
    hit = kv.plan_restore(4, c, b"")
    assert hit.hit_tokens == 3 * PT and hit.device_hit_tokens == 3 * PT
    kv.free(4)
    # Rank 0 has 5 free pages (4 for a, 1 new for sequence 3): a 6-page prompt that
    # extends a cannot fit there, so capacity wins over the hit.
    long = a[: 3 * PT] + tokens(3 * PT, 80)
    assert kv.ranks[0].pool.num_available == 5
    assert kv.place(5, long, b"") == 1
    for rid, rank in ((1, 0), (2, 1), (3, 0)):  # each open request on exactly one rank
        assert [rid in m._requests for m in kv.ranks] == [rank == 0, rank == 1]


def test_capacity_is_the_sum_and_a_sequence_is_bounded_by_one_pool():
    kv = make_dp(pages_per_rank=5, ranks=3)
    assert kv.num_pages == 5
    admit(kv, 1, tokens(2 * PT, 0))
    stats = kv.stats()
    assert stats.device_pages_total == 15 and stats.device_pages_in_use == 2
    # The node's pool bytes; the core's page tensors take no memory (the bytes are the workers').
    assert stats.page_tokens == PT and stats.device_bytes == 15 * kv.layout.page_bytes
    assert all(m.memory.pages.is_meta for m in kv.ranks)
    kv.free(1)
    assert kv.stats().device_pages_in_use == 0


def test_preemption_takes_the_newest_sequence_on_the_same_rank():
    kv = make_dp(pages_per_rank=4)
    cfg = EngineConfig(page_tokens=PT, max_num_batched_tokens=256, prefill_chunk_tokens=256)
    released: list[int] = []
    sched = Scheduler(cfg, kv, TINY, 16, lambda s: released.append(s.seq_id))
    seqs = [
        Sequence(i, f"r{i}", tokens(2 * PT - 1, 10 * i), 2 * PT - 1, arrival=i) for i in range(4)
    ]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()  # 2 pages each: two sequences per rank
    assert len(batch.prefills) == 4
    ranks = {s.seq_id: kv.pool_of(s.seq_id) for s in seqs}
    assert sorted(ranks.values()) == [0, 0, 1, 1]
    for c in batch.prefills:
        c.seq.num_computed = c.end
        c.seq.token_ids.extend([5, 5])  # two tokens each: the next decode needs a 3rd page
    # The oldest sequence of the rank that is NOT newest overall runs out first.
    newest = seqs[-1]
    other = 1 - ranks[newest.seq_id]
    victims = [s for s in reversed(seqs) if ranks[s.seq_id] == other]
    assert sched._victim(victims[-1]) is victims[0]
    assert sched._victim(newest) is newest
    sched.schedule()
    assert sched.num_preemptions >= 1
    # Every preempted sequence shared a rank with one that needed its pages, and no
    # sequence is open on two ranks.
    for s in seqs:
        assert [s.seq_id in m._requests for m in kv.ranks].count(True) <= 1


def test_placements_of_sequences_that_never_got_pages_do_not_count_as_load():
    kv = make_dp(pages_per_rank=4)
    for rid in range(300):  # placed, never admitted (aborted while waiting)
        kv.place(rid, tokens(PT, rid), b"")
    admit(kv, 1000, tokens(PT, 1))
    busy = kv.pool_of(1000)
    assert kv.place(1001, tokens(PT, 2), b"") == 1 - busy  # the admitted one is the load
    assert len(kv._rank) < 100  # stale placements are dropped as they pile up
