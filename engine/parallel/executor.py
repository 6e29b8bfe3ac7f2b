"""``ParallelExecutor``: the engine core's model runner when the model runs on worker ranks.

It implements ``engine.core.step.ModelRunner`` for ``LLMEngine``: the scheduler, the
sampler and the KV bookkeeping stay in the engine core, and each ``execute``
sends the step's sequences to the T x D workers (``engine/parallel/worker.py``) and
waits for their answers. What travels per step (``engine/parallel/worker_protocol.py``):
each sequence's block table, plan (stored tokens, layer starts) and the tokens
its worker has not seen yet; the rows of the step; the sequences whose runner
state to drop; a verifying decode's drafts, apart from its committed tokens. What
comes back: the logits rows of the sampled sequences (``[k + 1, vocab]`` for a
decode verifying ``k`` drafts), prompt-token scores and, for a drafter that reads
the target's layer inputs (``capture_hidden``), those rows (all from each DP
group's TP rank 0). Every rank of a DP group gets the same message, so the TP
ranks of a group hold the same KV bytes. Sampling stays in the core, so every
rank sees the same accepted tokens (docs/design/parallelism.md, "Speculative decoding").

Failure: the core polls its socket with a timeout and checks its local worker
processes and the workers' connections between polls; a worker that exits,
disconnects, reports an error or stays silent for ``worker_timeout_s`` fails
the step with ``WorkerFailure``. The core process then dies with it (its
``DeadMsg`` tells the API process, which fails every open request and answers
503), and the remaining workers exit (their connection to the core drops, or
their parent is gone).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq

from engine.api.image_wire import wire_image
from engine.api.request import TokenLogprob
from engine.config import EngineConfig
from engine.core.sequence import Sequence
from engine.core.speculation import Hidden
from engine.core.step import StepBatch
from engine.parallel import worker_protocol as wire
from engine.parallel.dp_kv import DataParallelKV

logger = logging.getLogger(__name__)

_POLL_MS = 100
# Loading a rank's share of a full checkpoint takes minutes; a local worker that fails
# to start is noticed at once (its exit), a remote one that never comes by this.
START_TIMEOUT_S = 1800.0
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


class WorkerFailure(RuntimeError):
    """A worker rank died, disconnected, failed its step or timed out."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_specs(
    config: EngineConfig, model: str, model_id: str, dist_port: int, core_port: int
) -> list[wire.WorkerSpec]:
    """The specs of this node's ranks (``config.node_rank``), in rank order."""
    per_node = config.world_size // config.nnodes
    first = config.node_rank * per_node
    return [
        wire.WorkerSpec(
            rank=first + i,
            world_size=config.world_size,
            local_rank=i,
            tensor_parallel_size=config.tensor_parallel_size,
            expert_parallel=config.enable_expert_parallel,
            dist_url=f"tcp://{config.master_addr}:{dist_port}",
            core_url=f"tcp://{config.master_addr}:{core_port}",
            model=model,
            model_id=model_id,
            device=config.device,
            dtype=config.dtype,
            quantization=config.quantization,
            kv_cache_bytes=config.kv_cache_bytes,
            page_tokens=config.page_tokens,
            kv_dtype=config.kv_dtype,
            max_num_seqs=config.max_num_seqs,
            timeout_s=config.worker_timeout_s,
            threads=config.worker_threads,
            parent_pid=os.getpid(),
            encoder_cache_bytes=config.encoder_cache_bytes,
        )
        for i in range(per_node)
    ]


def start_worker(spec: wire.WorkerSpec) -> subprocess.Popen:
    """``python -m engine.parallel.worker SPEC``: a process of its own (the engine core is a
    daemonic process, which multiprocessing does not let have children)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PROJECT_ROOT, env.get("PYTHONPATH")) if p)
    arg = wire.ENCODER.encode(spec).hex()
    return subprocess.Popen([sys.executable, "-m", "engine.parallel.worker", arg], env=env)


@dataclass(slots=True)
class StepTimes:
    """Cumulative seconds, for the benchmark's communication share."""

    steps: int = 0
    execute: float = 0.0  # whole ``execute`` in the core
    forward_max: float = 0.0  # the slowest rank's forward, summed over steps
    forward: list[float] = field(default_factory=list)  # per rank
    comm: list[float] = field(default_factory=list)  # per rank, inside collectives (timed)

    def reset(self) -> None:
        self.steps, self.execute, self.forward_max = 0, 0.0, 0.0
        self.forward = [0.0] * len(self.forward)
        self.comm = [0.0] * len(self.comm)


class ParallelExecutor:
    """``ModelRunner`` over worker ranks; see the module doc."""

    def __init__(
        self,
        config: EngineConfig,
        model: str,
        model_id: str,
        dp_of: Callable[[int], int],
    ) -> None:
        self.config = config
        self.world = config.world_size
        self.tp = config.tensor_parallel_size
        self.dp = config.data_parallel_size
        self._dp_of = dp_of  # seq id -> DP rank (the KV placement)
        self.kv: DataParallelKV | None = None  # the core's KV bookkeeping, set by the builder
        self._timeout = config.worker_timeout_s
        dist_port = config.master_port or free_port()
        core_port = config.master_port + 1 if config.master_port else free_port()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone worker raises
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        bind = "127.0.0.1" if config.nnodes == 1 else "0.0.0.0"
        self._sock.bind(f"tcp://{bind}:{core_port}")
        self._procs: dict[int, subprocess.Popen] = {}
        self._step = 0
        self._sent: dict[int, int] = {}  # seq id -> tokens its rank's mirror holds
        self._where: dict[int, int] = {}  # seq id -> DP rank that holds its state
        self._released: dict[int, list[int]] = {}
        self._scores: dict[int, list[TokenLogprob]] = {}
        # Speculation with a drafter here that reads the target's layer inputs: the layers
        # to capture (sent with the next step), and the last step's rows.
        self._capture: list[int] = []
        self._capture_sent = False
        self._hidden: Hidden = {}
        self._failed: str | None = None
        self.times = StepTimes(forward=[0.0] * self.world, comm=[0.0] * self.world)
        try:
            for spec in worker_specs(config, model, model_id, dist_port, core_port):
                self._procs[spec.rank] = start_worker(spec)
            self._wait_hello(START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ start
    def _wait_hello(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        seen: set[int] = set()
        while len(seen) < self.world:
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - seen)
                raise WorkerFailure(f"worker ranks {missing} did not start within {timeout:g} s")
            msg = self._recv()
            if isinstance(msg, wire.Hello):
                seen.add(msg.rank)

    # ------------------------------------------------------------ ModelRunner
    def release(self, seq: Sequence) -> None:
        dp = self._where.pop(seq.seq_id, None)
        self._sent.pop(seq.seq_id, None)
        if dp is not None:
            self._released.setdefault(dp, []).append(seq.seq_id)

    def take_prompt_logprobs(self) -> dict[int, list[TokenLogprob]]:
        scores, self._scores = self._scores, {}
        return scores

    def capture_hidden(self, layers: tuple[int, ...]) -> None:
        """Have each DP group's TP rank 0 keep the inputs of ``layers`` from the next step
        on and send them back (``take_hidden``): ``PagedModelRunner``'s surface, for a
        drafter that runs in the core (engine/core/speculation.py)."""
        self._capture, self._capture_sent = list(layers), False

    def take_hidden(self) -> Hidden:
        """seq_id -> layer -> (first position, its input rows) of the last step."""
        hidden, self._hidden = self._hidden, {}
        return hidden

    def execute(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        if self._failed is not None:
            raise WorkerFailure(self._failed)
        t0 = time.perf_counter()
        self._step += 1
        groups = [_Group() for _ in range(self.dp)]
        any_rows = False
        for seq in batch.decodes:
            drafts = batch.drafts.get(seq.seq_id, [])
            g = groups[self._state(seq, groups, len(drafts))]
            g.decodes.append(seq.seq_id)
            if drafts:
                g.drafts.append((seq.seq_id, drafts))
            any_rows = True
        for c in batch.prefills:
            g = groups[self._state(c.seq, groups, 0)]
            g.prefills.append((c.seq.seq_id, c.start, c.end, c.last))
            any_rows |= c.end > c.start
        fetching: list[tuple[list[list[tuple[bytes, int]]], dict[int, bytes]]] = []
        for dp, g in enumerate(groups):
            restore, segments = self._kv_traffic(dp)
            fetching.append((segments, {}))
            work = wire.StepWork(
                self._step,
                self._released.pop(dp, []),
                g.seqs,
                g.decodes,
                g.prefills,
                any_rows,
                restore,
                [p for segment in segments for _, p in segment],
                g.drafts,
                [] if self._capture_sent else self._capture,
            )
            data = wire.ENCODER.encode(work)
            for tp in range(self.tp):
                self._send(dp * self.tp + tp, data)
        self._capture_sent = True
        self._hidden = {}
        logits: dict[int, torch.Tensor] = {}
        pending = set(range(self.world))
        slowest = 0.0
        deadline = time.monotonic() + self._timeout
        while pending:
            msg = self._recv(deadline)
            if not isinstance(msg, wire.StepDone) or msg.step != self._step:
                continue
            if msg.error is not None:
                # A peer that died makes the survivors' collectives fail: name the dead one.
                cause = self._dead_worker(wait_s=1.0)
                first = msg.error.splitlines()[0]
                self._fail(
                    f"{cause + '; ' if cause else ''}worker rank {msg.rank} failed "
                    f"step {msg.step}: {first}"
                )
            pending.discard(msg.rank)
            self.times.forward[msg.rank] += msg.seconds
            self.times.comm[msg.rank] += msg.comm_seconds
            slowest = max(slowest, msg.seconds)
            for seq_id, row in msg.logits:
                array = np.frombuffer(row, dtype=np.dtype(msg.logits_dtype)).copy()
                if seq_id in batch.drafts:  # a verify chunk: one row per draft and one more
                    array = array.reshape(len(batch.drafts[seq_id]) + 1, -1)
                logits[seq_id] = torch.from_numpy(array)
            for h in msg.hidden:
                self._hidden.setdefault(h.seq_id, {})[h.layer] = (h.first, wire.rows_of(h))
            for seq_id, scores in msg.prompt_scores:
                self._scores.setdefault(seq_id, []).extend(scores)
            if msg.pages:
                fetching[msg.rank // self.tp][1].update(msg.pages)
        for segments, rows in fetching:
            if segments and self.kv is not None:
                self.kv.write_fetched(segments, rows)
        self.times.steps += 1
        self.times.forward_max += slowest
        self.times.execute += time.perf_counter() - t0
        return logits

    def _kv_traffic(self, dp: int) -> tuple[list[tuple[int, bytes]], list[list[tuple[bytes, int]]]]:
        """DP rank ``dp``'s SSD-tier traffic for this step: pages restored into it since
        the last step, and committed chain segments whose bytes to fetch for writing."""
        if self.kv is None:
            return [], []
        return self.kv.take_traffic(dp)

    def flush_kv(self) -> None:
        """Fetch and write every committed page still waiting for its bytes (shutdown)."""
        if self.kv is None or self._failed is not None:
            return
        if self.kv.has_traffic():
            self.execute(StepBatch())

    def _state(self, seq: Sequence, groups: list[_Group], drafts: int) -> int:
        """Put ``seq``'s state (token delta, table, plan) in its DP group's message.
        ``drafts``: the draft tokens at the end of ``seq.token_ids`` this step; they
        travel in ``StepWork.drafts``, never in the delta, so a worker's mirror holds
        exactly the committed tokens between steps."""
        dp = self._dp_of(seq.seq_id) if self.dp > 1 else 0
        self._where[seq.seq_id] = dp
        base = self._sent.get(seq.seq_id, 0)
        committed = seq.num_tokens - drafts
        groups[dp].seqs.append(
            wire.SeqState(
                seq_id=seq.seq_id,
                token_base=base,
                new_tokens=seq.token_ids[base:committed],
                num_prompt_tokens=seq.num_prompt_tokens,
                block_table=seq.block_table,
                stored_tokens=seq.stored_tokens,
                layer_starts=list(seq.layer_starts),
                prefill_only=seq.prefill_only,
                prompt_logprobs=seq.prompt_logprobs,
                prompt_scored=seq.prompt_scored,
                images=[wire_image(i) for i in seq.images] if base == 0 else [],
                num_computed=seq.num_computed,
            )
        )
        self._sent[seq.seq_id] = committed
        return dp

    # ------------------------------------------------------------ channel
    def _send(self, rank: int, data: bytes) -> None:
        try:
            self._sock.send_multipart([str(rank).encode(), data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._fail(f"worker rank {rank} is not reachable ({exc})")

    def _recv(self, deadline: float | None = None) -> wire.Hello | wire.StepDone:
        """The next worker message; raises ``WorkerFailure`` when a worker is gone first."""
        while True:
            if self._sock.poll(_POLL_MS):
                _identity, data = self._sock.recv_multipart()
                return wire.FROM_WORKER.decode(data)
            cause = self._dead_worker()
            if cause:
                self._fail(cause)
            if self._monitor.poll(0):
                self._fail("a worker rank closed its connection to the engine core")
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"no answer from every worker rank within {self._timeout:g} s")

    def _dead_worker(self, wait_s: float = 0.0) -> str | None:
        """Which local worker exited, waiting up to ``wait_s`` for one to; None if none."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in self._procs.items():
                code = proc.poll()
                if code is not None:
                    return f"worker rank {rank} (pid {proc.pid}) exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _fail(self, message: str) -> None:
        self._failed = message
        logger.error("%s", message)
        raise WorkerFailure(message)

    @property
    def worker_pids(self) -> dict[int, int]:
        """This node's worker processes by rank (tests kill one)."""
        return {rank: p.pid for rank, p in self._procs.items()}

    def close(self) -> None:
        """Stop the workers (they exit on ``Stop``, or when the socket closes) and reap them."""
        if self._ctx.closed:
            return
        with contextlib.suppress(WorkerFailure):  # already logged; the close goes on
            self.flush_kv()
        if self._failed is None:
            for rank in range(self.world):
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart(
                        [str(rank).encode(), wire.ENCODER.encode(wire.Stop())], zmq.NOBLOCK
                    )
        self._sock.disable_monitor()
        # After a failure the survivors may sit in a collective with a dead peer: the
        # closed connection tells them, and they get a second before they are killed.
        self._ctx.destroy(linger=1000)
        deadline = time.monotonic() + (10.0 if self._failed is None else 1.0)
        for proc in self._procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass(slots=True)
class _Group:
    seqs: list[wire.SeqState] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)
    prefills: list[tuple[int, int, int, bool]] = field(default_factory=list)
    drafts: list[tuple[int, list[int]]] = field(default_factory=list)
