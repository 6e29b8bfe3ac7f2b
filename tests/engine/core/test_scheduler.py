"""Scheduler rules, each checked against hand-computed batches (no model)."""

from __future__ import annotations

from engine_helpers import TINY, make_kv

from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceStatus, TokenSlice
from engine.core.step import StepBatch

W = 16  # replay window (the tiny model's sliding window)


def make_scheduler(num_pages: int = 64, page_tokens: int = 8, **config) -> Scheduler:
    released: list[int] = []
    cfg = EngineConfig(page_tokens=page_tokens, **config)
    sched = Scheduler(
        cfg, make_kv(num_pages, page_tokens), TINY, W, lambda s: released.append(s.seq_id)
    )
    sched.released = released  # type: ignore[attr-defined]
    return sched


def make_seq(seq_id: int, n: int, *, priority: int = 0, arrival: float | None = None, base=0):
    tokens = [(base + seq_id * 7 + i) % 50 + 3 for i in range(n)]
    arrival = float(seq_id) if arrival is None else arrival
    return Sequence(seq_id, f"r{seq_id}", tokens, n, priority=priority, arrival=arrival)


def advance(sched: Scheduler, batch: StepBatch, token: int = 5) -> None:
    """What the engine does after ``execute``: move progress, append, commit."""
    for chunk in batch.prefills:
        chunk.seq.num_computed = chunk.end
    for seq in batch.decodes:
        seq.num_computed = seq.num_tokens
    for seq in batch.sampled():
        seq.token_ids.append(token)
        sched.kv.commit_full_pages(seq.seq_id, seq.token_ids[: seq.num_computed], seq.salt)


def shape(batch: StepBatch) -> tuple[list[int], list[tuple[int, int, int, bool]]]:
    return (
        [s.seq_id for s in batch.decodes],
        [(c.seq.seq_id, c.start, c.end, c.last) for c in batch.prefills],
    )


def test_token_budget_caps_chunks_and_admissions():
    sched = make_scheduler(max_num_batched_tokens=40, prefill_chunk_tokens=64)
    for i in range(3):
        sched.add(make_seq(i, 30))
    batch = sched.schedule()
    # A takes 30 rows, B the 10 left; C waits for budget.
    assert shape(batch) == ([], [(0, 0, 30, True), (1, 0, 10, False)])
    assert batch.num_tokens == 40
    assert [s.seq_id for s in sched.waiting] == [2]
    advance(sched, batch)
    batch = sched.schedule()
    # A decodes first (1 row), B continues with 20, C gets the 19 left.
    assert shape(batch) == ([0], [(1, 10, 30, True), (2, 0, 19, False)])
    assert batch.num_tokens == 40


def test_decodes_come_first_and_can_exhaust_the_budget():
    sched = make_scheduler(max_num_batched_tokens=3, prefill_chunk_tokens=64)
    for i in range(3):
        sched.add(make_seq(i, 1))
    advance(sched, sched.schedule())  # all three prefilled in one step (1 row each)
    sched.add(make_seq(3, 10))
    batch = sched.schedule()
    assert shape(batch) == ([0, 1, 2], [])  # the budget went to decodes
    advance(sched, batch)
    sched.config.max_num_batched_tokens = 5
    assert shape(sched.schedule()) == ([0, 1, 2], [(3, 0, 2, False)])


def test_chunked_prefill_marks_only_the_final_chunk_last():
    sched = make_scheduler(prefill_chunk_tokens=7)
    sched.add(make_seq(0, 20))
    chunks = []
    for _ in range(3):
        batch = sched.schedule()
        chunks += shape(batch)[1]
        advance(sched, batch)
    assert chunks == [(0, 0, 7, False), (0, 7, 14, False), (0, 14, 20, True)]
    assert shape(sched.schedule()) == ([0], [])


def test_max_num_seqs_caps_admissions():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(i, 5) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [c.seq.seq_id for c in batch.prefills] == [0, 1]
    advance(sched, batch)
    sched.finish(seqs[0])
    assert seqs[0].status is SequenceStatus.FINISHED
    batch = sched.schedule()
    assert shape(batch) == ([1], [(2, 0, 5, True)])
    assert sched.kv.stats().device_pages_in_use == 2  # seq 0's page was released


def test_priority_then_arrival_order():
    sched = make_scheduler(max_num_seqs=1)
    order = [(0, 2, 0.0), (1, 0, 3.0), (2, 1, 1.0), (3, 0, 2.0)]  # (id, priority, arrival)
    seqs = {i: make_seq(i, 3, priority=p, arrival=a) for i, p, a in order}
    for s in seqs.values():
        sched.add(s)
    admitted = []
    for _ in range(4):
        batch = sched.schedule()
        (chunk,) = batch.prefills
        admitted.append(chunk.seq.seq_id)
        sched.finish(chunk.seq)
    assert admitted == [3, 1, 2, 0]


def test_out_of_pages_preempts_the_newest_and_it_resumes_by_restore():
    # 5 pages of 8 tokens. Three sequences of 12 tokens take 2 pages each once
    # decoding, so the third cannot get its second page.
    sched = make_scheduler(num_pages=5, max_num_seqs=8)
    seqs = [make_seq(i, 12) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert [c.seq.seq_id for c in batch.prefills] == [0, 1]  # 2 + 2 pages; 1 left < 2
    advance(sched, batch)
    # Decode until seq 0 needs its third page (at 17 tokens): pool holds 4 in use.
    for _ in range(4):
        advance(sched, sched.schedule())
    assert sched.kv.stats().device_pages_in_use == 4
    assert seqs[0].num_tokens == 17 and seqs[1].num_tokens == 17
    batch = sched.schedule()  # seq 0 takes the last page; seq 1 (newest) is preempted
    assert shape(batch) == ([0], [])
    assert sched.num_preemptions == 1 and seqs[1].num_preemptions == 1
    assert seqs[1].status is SequenceStatus.WAITING and sched.released == [1]
    assert [s.seq_id for s in sched.waiting] == [1, 2]  # ahead of the later arrival
    # Its two full pages (tokens 0..15, committed) stay cached.
    stats = sched.kv.stats()
    assert stats.device_pages_in_use == 3 and stats.device_pages_cached == 2
    advance(sched, batch)
    sched.finish(seqs[0])
    batch = sched.schedule()
    chunk = batch.prefills[0]
    assert [c.seq.seq_id for c in batch.prefills] == [1, 2]
    s1 = seqs[1]
    # Resume = restore: H = 16 (two full pages, capped at (17 - 1) // 8), decoder
    # rows from L - W = 1; the replay triangle below H reaches row 0.
    assert (s1.stored_tokens, s1.encoder_start, s1.decoder_start, s1.prefill_end) == (16, 0, 1, 17)
    assert (chunk.start, chunk.end, chunk.last) == (0, 17, True)
    assert s1.prompt_hit_tokens == 0  # usage keeps the first admission's hit
    assert s1.replay_tokens == 16


def test_a_step_that_preempts_admits_nobody():
    sched = make_scheduler(num_pages=3, max_num_seqs=8)
    a, b = make_seq(0, 8), make_seq(1, 8)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())  # both admitted: one page each
    sched.add(make_seq(2, 1))
    batch = sched.schedule()  # both need a second page: b is preempted for a
    assert shape(batch) == ([0], [])
    assert [s.seq_id for s in sched.waiting] == [1, 2]


def test_admission_waits_for_pages_of_the_whole_prompt():
    sched = make_scheduler(num_pages=4, prefill_chunk_tokens=8)
    sched.add(make_seq(0, 16))
    advance(sched, sched.schedule())
    sched.add(make_seq(1, 24))  # needs 3 pages
    batch = sched.schedule()
    # Seq 0's second chunk takes its second page first: 2 left < 3.
    assert shape(batch) == ([], [(0, 8, 16, True)])
    assert [s.seq_id for s in sched.waiting] == [1]
    assert sched.kv.stats().lookups == 1  # no lookup for a prompt that cannot fit


def test_prefix_hit_sets_the_restore_plan():
    sched = make_scheduler(prefill_chunk_tokens=128)
    first = make_seq(0, 100)
    sched.add(first)
    advance(sched, sched.schedule())  # 100 rows; 12 full pages committed
    sched.finish(first)
    second = make_seq(1, 100)
    second.token_ids = list(first.token_ids[:100])
    sched.add(second)
    batch = sched.schedule()
    # H = 96 (twelve pages), d0 = L - W = 84. The decoder's first row reads layer
    # B's keys from 84 - 15 = 69; each encoder layer below starts one window
    # (15 rows) earlier: 54, 39, 24, 9 (the tiny model has B = 4).
    assert (second.stored_tokens, second.encoder_start, second.decoder_start) == (96, 9, 84)
    assert second.layer_starts == (9, 24, 39, 54, 69, 84, 84, 84, 84)
    assert shape(batch) == ([], [(1, 9, 100, True)])
    assert second.prompt_hit_tokens == second.prompt_device_hit_tokens == 96
    assert batch.num_tokens == 91  # the budget pays for replayed rows too


def test_disabled_ced_runs_the_decoder_from_the_encoder_start():
    sched = make_scheduler(enable_ced=False)
    s = make_seq(0, 45)
    sched.add(s)
    sched.schedule()
    assert (s.stored_tokens, s.encoder_start, s.decoder_start) == (0, 0, 0)


def test_token_slice_reads_like_a_list_slice():
    ids = list(range(100, 113))
    for start in range(0, 14):
        for stop in range(start, 14):
            view, want = TokenSlice(ids, start, stop), ids[start:stop]
            assert len(view) == len(want) and list(view) == want
            assert view[:] == want and view[1:4] == want[1:4] and view[-3:] == want[-3:]
            if want:
                assert (view[0], view[-1]) == (want[0], want[-1])
    ids.append(7)  # a view of a growing list sees only its window
    assert list(TokenSlice(ids, 10, 13)) == [110, 111, 112]


def test_many_waiting_sequences_add_and_finish_in_log_time():
    """50,000 queued sequences finished in random order (docs/design/hardening.md,
    "Fan-out is bounded and fair"). A sorted Python list pays a scan and a shift per
    removal (about 1e9 slow comparisons here, a minute or more); the sorted queue pays
    O(log n) each (well under a second)."""
    import random
    import time

    sched = make_scheduler()
    seqs = [Sequence(i, f"r{i // 100}", [3], 1, arrival=float(i % 977)) for i in range(50_000)]
    started = time.perf_counter()
    for seq in seqs:
        sched.add(seq)
    order = [s.seq_id for s in sched.waiting]
    assert order == [s.seq_id for s in sorted(seqs, key=lambda s: s.sort_key)]
    random.Random(0).shuffle(seqs)
    for seq in seqs[:49_990]:
        sched.finish(seq)
    elapsed = time.perf_counter() - started
    left = sorted(seqs[49_990:], key=lambda s: s.sort_key)
    assert [s.seq_id for s in sched.waiting] == [s.seq_id for s in left]
    assert elapsed < 5.0, f"{elapsed:.1f} s for 50,000 adds and removals"
