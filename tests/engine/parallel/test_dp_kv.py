"""DP attention's KV bookkeeping (engine/parallel/dp_kv.py) and the scheduler over it, no model.

Placement rules checked on hand-built cases: a prompt whose prefix is cached
on one rank goes there even when that rank is busier; without a hit the
least-loaded rank takes it; a rank that cannot hold the pages is passed over
even with the hit. Preemption frees pages on the rank that needs them. The DP bookkeeping plans
exactly what one rank's ``KVCacheManager`` plans, and holds no KV bytes.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from engine_helpers import TINY

from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.parallel.dp_kv import DataParallelKV
from kvstore.device.layout import kv_layout
from kvstore.device.page_hash import chain_hashes
from kvstore.local import open_local_kv
from kvstore.manager import KVCacheManager, KVManager

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
        assert [m.holds(rid) for m in kv.ranks] == [rank == 0, rank == 1]


def test_capacity_is_the_sum_and_a_sequence_is_bounded_by_one_pool():
    kv = make_dp(pages_per_rank=5, ranks=3)
    assert kv.num_pages == 5
    admit(kv, 1, tokens(2 * PT, 0))
    stats = kv.stats()
    assert stats.device_pages_total == 15 and stats.device_pages_in_use == 2
    # The node's pool bytes, though the core holds none (the bytes are the workers').
    assert stats.page_tokens == PT and stats.device_bytes == 15 * kv.layout.page_bytes
    assert not _tensors(kv)
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
        assert [m.holds(s.seq_id) for m in kv.ranks].count(True) <= 1


def test_placements_of_sequences_that_never_got_pages_do_not_count_as_load():
    kv = make_dp(pages_per_rank=4)
    for rid in range(300):  # placed, never admitted (aborted while waiting)
        kv.place(rid, tokens(PT, rid), b"")
    admit(kv, 1000, tokens(PT, 1))
    busy = kv.pool_of(1000)
    assert kv.place(1001, tokens(PT, 2), b"") == 1 - busy  # the admitted one is the load
    assert len(kv._rank) < 100  # stale placements are dropped as they pile up


def _tensors(obj: object, seen: set[int] | None = None) -> list[str]:
    """Paths of every tensor reachable from ``obj``'s attributes and containers (the SSD
    tier's threads and files aside: it holds no device page)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, str | bytes | int | float | bool | type(None)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return ["<tensor>"]
    if isinstance(obj, dict):
        children = list(obj.items())
    elif isinstance(obj, list | tuple | set):
        children = list(enumerate(obj))
    else:
        names = getattr(obj, "__dict__", {}).keys() | set(getattr(obj, "__slots__", ()))
        children = [(n, getattr(obj, n)) for n in names if n != "store" and hasattr(obj, n)]
    return [f"{k}.{p}" for k, v in children for p in _tensors(v, seen)]


def test_the_bookkeeping_holds_no_tensor():
    layout = kv_layout(TINY.kv_source_layer_ids, TINY.compress_ratios, PT, "fp4")
    alone = KVCacheManager(layout, 8)
    alone.plan_restore(1, tokens(3 * PT, 0), b"")
    alone.allocate(1, 3 * PT)
    assert not _tensors(alone)
    kv, pages = open_local_kv(layout, 8 * layout.page_bytes)
    assert isinstance(pages.pages, torch.Tensor)  # the runner's: not the manager's
    assert not _tensors({k: v for k, v in vars(kv).items() if v is not kv.pages})


def test_both_implementations_have_the_manager_interface():
    members = [
        n for n in dir(KVManager) if not n.startswith("_") and n not in ("page_tokens", "num_pages")
    ]
    assert {"plan_restore", "allocate", "commit_full_pages", "publish", "free"} <= set(members)
    for cls in (KVCacheManager, DataParallelKV):
        for name in members:
            want = inspect.signature(getattr(KVManager, name))
            assert inspect.signature(getattr(cls, name)) == want, (cls.__name__, name)


def _content(page_hash: bytes, nbytes: int) -> bytes:
    """The bytes the "model" wrote into the page named ``page_hash``."""
    return bytes([page_hash[0]]) * nbytes


def _drive(kv, write, loaded) -> list[tuple]:
    """The same requests through either implementation: a cold prompt, a device hit,
    a restore from SSD after its pages were evicted, a tenant miss, a preemption.
    ``write(table, hashes)`` stands for the forward writing a request's full pages."""
    trace = []
    a = tokens(4 * PT + 3, 0)

    def run(rid, ids, salt=b"", commit=True):
        kv.place(rid, ids, salt)
        plan = kv.plan_restore(rid, ids, salt)
        table = kv.allocate(rid, len(ids))
        if commit:
            hashes = chain_hashes(ids, salt, PT)
            write(table[len(plan.page_ids) : len(hashes)], hashes[len(plan.page_ids) :])
            kv.commit_full_pages(rid, ids, salt)
        trace.append((plan.page_ids, plan.hit_tokens, plan.device_hit_tokens, table, loaded()))

    run(1, a)
    kv.free(1)
    run(2, a[: 3 * PT] + tokens(5, 40))  # a 3-page device hit
    kv.free(2)
    run(3, tokens(14 * PT, 90))  # evicts most of a's cached pages
    kv.free(3)
    kv.flush()  # a's page files are written
    run(4, a)  # the head from the device, the rest from SSD
    run(5, a, salt=b"other")  # another tenant: nothing shared
    kv.free(5)
    kv.free(4)  # preempted: its pages stay cached; its next admission hits them all
    run(6, a, commit=False)
    kv.flush()
    stats = kv.stats()
    trace.append((stats.lookups, stats.device_hit_tokens, stats.ssd_hit_tokens, stats.ssd.reads))
    return trace


def test_one_dp_rank_plans_what_one_manager_plans(tmp_path: Path):
    """Plans, block tables, hit counts and the SSD pages each brings back are equal."""
    layout = kv_layout(TINY.kv_source_layer_ids, TINY.compress_ratios, PT, "fp4")
    nbytes = layout.page_bytes
    local, pages = open_local_kv(layout, 16 * nbytes, kv_dir=tmp_path / "one", kv_dir_bytes=10**9)
    # What the one manager restores lands in the runner's pool: (page, bytes) in order.
    restored: list[tuple[int, bytes]] = []
    load = pages.load

    def spy(chain):
        ok = load(chain)
        restored.extend(pages.copy_out([p for (_, p), good in zip(chain, ok, strict=True) if good]))
        return ok

    def write(table, hashes):
        for page, h in zip(table, hashes, strict=True):
            pages.pages[page] = torch.frombuffer(bytearray(_content(h, nbytes)), dtype=torch.uint8)

    pages.load = spy  # type: ignore[method-assign]
    one = _drive(local, write, lambda: len(restored))
    local.close()

    dp = DataParallelKV(layout, 16 * nbytes, 1, tmp_path / "dp", 10**9)
    shipped: list[tuple[int, bytes]] = []

    def traffic() -> int:
        got, segments = dp.take_traffic(0)
        shipped.extend(got)
        # The worker hands back each committed page's bytes, as the model wrote them.
        rows = {p: _content(h, nbytes) for seg in segments for h, p in seg}
        if segments:
            dp.write_fetched(segments, rows)
        return len(shipped)

    two = _drive(dp, lambda table, hashes: None, traffic)
    dp.close()
    assert one == two
    assert one[3][1] == 4 * PT and one[3][2] < 4 * PT  # run 4 restored from SSD
    assert restored == shipped and len(shipped) == 4 * PT // PT - one[3][2] // PT
