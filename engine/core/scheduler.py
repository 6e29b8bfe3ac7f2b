"""Which rows run this step (docs/design/architecture.md §2.4, docs/design/engine.md).

Each step, under a token budget (one row per decode, a chunk's encoder rows
per prefill) and a cap on admitted sequences:

1. decode every running sequence whose prefill is done (decode first: a token
   waiting to be decoded is a user waiting on latency);
2. continue running prefills, one chunk of at most ``prefill_chunk_tokens``
   rows each;
3. admit waiting sequences in order (priority, then arrival): the KV store
   finds the cached prefix (device hit, SSD hit), the sequence's replay plan
   is fixed (``engine.model.semantics.replay``), and its first chunk is scheduled.

Pages are allocated as chunks and decodes need them. When the pool runs out,
the newest running sequence (last in scheduling order) is preempted: its pages
are released (committed full pages stay cached), its runner state dropped, and
it waits again; its next admission restores from the cache. No new sequence
is admitted in a step that preempted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from sortedcontainers import SortedKeyList

from engine.config import EngineConfig
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.step import PrefillChunk, StepBatch
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.semantics.replay import ReplayPlan
from kvstore.device.block_pool import OutOfPages
from kvstore.manager import KVManager


class Scheduler:
    """Waiting and running queues over one ``KVManager`` (block ids only, no bytes)."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVManager,
        model_config: ModelConfig,
        replay_tokens: int,
        release: Callable[[Sequence], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.model_config = model_config
        self.replay_tokens = replay_tokens
        self._release = release  # the runner's: drop a sequence's SWA / compressor state
        self._clock = clock
        # Sorted by Sequence.sort_key (unique: it ends in seq_id). Sorted lists, not
        # lists: inserting or removing one of many waiting sequences (a large fan-out
        # aborted at once) costs O(log n), not a scan and a shift of the whole queue.
        self.waiting: SortedKeyList = SortedKeyList(key=_key)
        self.running: SortedKeyList = SortedKeyList(key=_key)
        self.num_preemptions = 0

    # ------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        self.waiting.add(seq)

    def finish(self, seq: Sequence) -> None:
        """Take ``seq`` out of the queues and give back its pages and runner state."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._drop_state(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finished = self._clock()

    def pages_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.kv.page_tokens)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> StepBatch:
        batch = StepBatch()
        preempted = False

        for seq in list(self.running):  # 1. decodes
            if self._budget(batch) == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or seq.in_prefill:
                continue
            # Row num_tokens - 1 (the token sampled last step) gets its KV written.
            ok, hit = self._reserve(seq, seq.num_tokens, batch)
            preempted |= hit
            if ok:
                batch.decodes.append(seq)

        for seq in list(self.running):  # 2. running prefills
            budget = self._budget(batch)
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or not seq.in_prefill:
                continue
            end = min(seq.prefill_end, seq.num_computed + self._chunk(budget))
            ok, hit = self._reserve(seq, end, batch)
            preempted |= hit
            if ok:
                batch.prefills.append(
                    PrefillChunk(seq, seq.num_computed, end, end == seq.prefill_end)
                )

        while not preempted and self.waiting:  # 3. admissions
            budget = self._budget(batch)
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break  # FCFS: nobody overtakes the head of the queue
            batch.prefills.append(chunk)
        return batch

    def _budget(self, batch: StepBatch) -> int:
        return self.config.max_num_batched_tokens - batch.num_tokens

    def _chunk(self, budget: int) -> int:
        return min(self.config.prefill_chunk_tokens, budget)

    def _admit(self, seq: Sequence, budget: int) -> PrefillChunk | None:
        """Plan ``seq``'s restore and its first chunk, or None if the pool cannot take it."""
        # A prefill holds pages for its whole sequence before it yields a token;
        # admitting without them would only start work that preemption throws away.
        # A waiting sequence holds no pages, so this asks for all of them.
        # DP attention chooses the sequence's rank first (dp_kv.py); one pool has one.
        spans = seq.span_keys
        self.kv.place(seq.seq_id, seq.token_ids, seq.salt, not seq.prefill_only, spans=spans)
        if not self.kv.can_allocate(seq.seq_id, seq.num_tokens):
            return None
        hit = self.kv.plan_restore(
            seq.seq_id, seq.token_ids, seq.salt, need_logits=not seq.prefill_only, spans=spans
        )
        if seq.scores_prompt:
            plan = ReplayPlan.every_row(self.model_config, hit.hit_tokens)
        else:
            plan = ReplayPlan.prefill(
                self.model_config,
                seq.num_tokens,
                self.replay_tokens,
                stored_tokens=hit.hit_tokens,
                ced=self.config.enable_ced,
                need_logits=not seq.prefill_only,
            )
        # A prefill-only sequence whose every page hit gets a chunk of no rows.
        end = min(seq.num_tokens, plan.encoder_start + self._chunk(budget))
        try:
            block_table = self.kv.allocate(seq.seq_id, end)
        except OutOfPages:  # hit pages held by others made the estimate optimistic
            self.kv.free(seq.seq_id)
            return None
        if seq.num_admissions == 0:
            seq.prompt_hit_tokens = hit.hit_tokens
            seq.prompt_device_hit_tokens = hit.device_hit_tokens
            seq.prompt_ssd_hit_tokens = hit.ssd_hit_tokens
        seq.admit(plan, plan.decoder_start(self.model_config))
        seq.block_table = block_table
        if seq.first_scheduled is None:
            seq.first_scheduled = self._clock()
        self.waiting.pop(0)
        self.running.add(seq)
        return PrefillChunk(seq, seq.num_computed, end, end == seq.prefill_end)

    def _reserve(self, seq: Sequence, num_tokens: int, batch: StepBatch) -> tuple[bool, bool]:
        """Pages for ``num_tokens`` of ``seq``, preempting the newest until they fit.

        Returns (reserved, preempted anyone). ``seq`` itself may be the newest:
        then it is preempted and not reserved.
        """
        preempted = False
        while not self.kv.can_allocate(seq.seq_id, num_tokens):
            victim = self._victim(seq)
            self._preempt(victim, batch)
            preempted = True
            if victim is seq:
                return False, True
        seq.block_table = self.kv.allocate(seq.seq_id, num_tokens)
        return True, preempted

    def _victim(self, seq: Sequence) -> Sequence:
        """The newest running sequence whose pages share ``seq``'s pool (under DP
        attention, preempting another rank's sequence frees nothing for ``seq``)."""
        mine = self.kv.pool_of(seq.seq_id)
        return next(v for v in reversed(self.running) if self.kv.pool_of(v.seq_id) == mine)

    def _preempt(self, seq: Sequence, batch: StepBatch) -> None:
        """Back to waiting; drop pages and runner state, and any work of this step."""
        self.running.remove(seq)
        if seq in batch.decodes:
            batch.decodes.remove(seq)
        batch.prefills = [c for c in batch.prefills if c.seq is not seq]
        self._drop_state(seq)
        seq.reset_for_preemption()
        self.num_preemptions += 1
        self.waiting.add(seq)

    def _drop_state(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        self._release(seq)
        seq.block_table = []


def _key(seq: Sequence) -> tuple[int, float, int]:
    return seq.sort_key
