"""Run the tiny model on 2 gloo ranks in 2 processes (tests of engine/model/parallel.py).

``run_ranks`` spawns the ranks on loopback and collects what each returns; a
rank that fails or hangs fails the test with its traceback, never a hang.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from engine.model.kv.dense_backend import DenseKV, KVPrecision
from engine.model.semantics.replay import ReplayPlan

EXACT_KV = KVPrecision(global_kv="exact", swa="exact")
TIMEOUT_S = 120


# (tensor_parallel_size, expert_parallel, quantization: "none" or "auto" = packed experts)
Topology = tuple[int, bool, str]


@dataclass(frozen=True)
class Job:
    """What every rank runs: the checkpoint, the topologies (one model each, one
    process group for all: spawning and importing cost more than a forward) and
    the prompts."""

    checkpoint: Path
    topologies: tuple[Topology, ...]
    prompts: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class RankResult:
    rank: int
    topology: Topology
    # prompt index -> logits of the prompts this rank ran (numpy: pickled by value,
    # not through a shared-memory handle that dies with the rank)
    logits: dict[int, np.ndarray]
    expert_bytes: int  # resident routed-expert bytes (parameters and buffers)
    total_expert_bytes: int  # the same, if this rank held every expert


def forward_logits(model, ids: tuple[int, ...]) -> torch.Tensor:
    tokens = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        plan = ReplayPlan.exact(model.config)  # every layer over every token
        return model(tokens, DenseKV(model.config, tokens, plan, None, EXACT_KV, torch.float64))


def routed_expert_bytes(model) -> tuple[int, int]:
    """(resident bytes of the text layers' routed experts, the bytes all E would take).

    The DSpark drafter's are left out: a TP / EP rank builds no drafter (yet)."""
    from engine.model.deepseek_v41.routed_experts import RoutedExperts

    held = whole = 0
    for name, module in model.named_modules():
        if isinstance(module, RoutedExperts) and not name.startswith("mtp."):
            n = sum(t.nbytes for t in [*module.parameters(), *module.buffers()])
            held += n
            whole += n // module.n_experts * module.total
    return held, whole


def join_gloo(rank: int, world: int, port: int) -> None:
    """One thread, and this rank in a loopback gloo group of ``world`` processes."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )


def _rank(rank: int, world: int, port: int, job: Job, out: mp.Queue) -> None:
    try:
        from engine.loader.checkpoint import load_checkpoint
        from engine.model.parallel import world_parallel

        join_gloo(rank, world, port)
        results = []
        for tp, ep, quantization in job.topologies:
            parallel = world_parallel(tp, ep)
            # float64 like the tests' other models: fp32 parameters (mHC, sinks) widened too.
            _, model = load_checkpoint(job.checkpoint, quantization=quantization, parallel=parallel)
            model = model.double().eval()
            # DP attention: each rank runs its own prompts (different lengths at once);
            # otherwise every rank runs every prompt.
            mine = range(len(job.prompts))
            if parallel.ep_dispatch:
                mine = range(rank, len(job.prompts), world)
            logits = {i: forward_logits(model, job.prompts[i]).numpy() for i in mine}
            held, whole = routed_expert_bytes(model)
            results.append(RankResult(rank, (tp, ep, quantization), logits, held, whole))
        out.put(results)
        dist.destroy_process_group()
    except BaseException:
        out.put((rank, traceback.format_exc()))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(job: Job, world: int = 2) -> dict[Topology, list[RankResult]]:
    """Each topology's results, by rank."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, job, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: list[RankResult] = []
    n_results = world * len(job.topologies)
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while len(results) < n_results:
            try:
                got = out.get(timeout=1)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:  # died without reporting (killed, or failed before the try)
                    raise AssertionError(f"a rank exited with {dead[0]}") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"no result from every rank in {TIMEOUT_S} s") from None
                continue
            if isinstance(got, tuple):
                raise AssertionError(f"rank {got[0]} failed:\n{got[1]}")
            results.extend(got)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    by_topology: dict[Topology, list[RankResult]] = {}
    for r in sorted(results, key=lambda r: r.rank):
        by_topology.setdefault(r.topology, []).append(r)
    return by_topology
