"""``flashserve serve``'s parallel-serving flags, and what a node other than node 0 runs.

Node 0 runs the API and the engine core, which starts that node's worker ranks
itself (engine/parallel/executor.py). Every other node runs the same command with its
``--node-rank``: it starts its own ranks, which connect to node 0's engine core
(``--master-addr``, port ``--master-port`` + 1) and to torch.distributed
(``--master-port``), and serves no API. Defaults come from torchrun's
environment when it is set (one serve process per node: ``MASTER_ADDR``,
``MASTER_PORT``, ``NNODES`` or ``WORLD_SIZE``, ``NODE_RANK`` or ``RANK``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def _env_int(*names: str, default: int) -> int:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return default


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallel serving (docs/design/parallelism.md)")
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="T: ranks that split each layer's query heads, o-groups and shared expert (default 1)",
    )
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="D: data-parallel attention; each sequence lives on one of D rank groups, whose "
        "KV pools add up (default 1). T x D ranks in all, one worker process each",
    )
    group.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="shard the routed experts over all T x D ranks (EP) instead of keeping all on each",
    )
    group.add_argument(
        "--nnodes",
        type=int,
        default=_env_int("NNODES", "WORLD_SIZE", default=1),
        help="nodes the T x D ranks spread over (default 1; torchrun's NNODES / WORLD_SIZE)",
    )
    group.add_argument(
        "--node-rank",
        type=int,
        default=_env_int("NODE_RANK", "RANK", default=0),
        help="this node (0 serves the API; default 0; torchrun's NODE_RANK / RANK)",
    )
    group.add_argument(
        "--master-addr",
        default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        help="node 0's address (default MASTER_ADDR, else 127.0.0.1)",
    )
    group.add_argument(
        "--master-port",
        type=int,
        default=_env_int("MASTER_PORT", default=0),
        help="torch.distributed's port on node 0; the engine core's step channel uses the next "
        "one (default MASTER_PORT, else any free port; several nodes need it)",
    )
    group.add_argument(
        "--worker-timeout",
        type=float,
        default=120.0,
        help="seconds one step (or collective) may take on the worker ranks before serving "
        "fails (default %(default)s)",
    )
    group.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="torch intra-op threads per worker rank (default: torch's, OMP_NUM_THREADS)",
    )


def parallel_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields of these flags."""
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "worker_timeout_s": args.worker_timeout,
        "worker_threads": args.worker_threads,
    }


def run_node_workers(config: Any, path: Path, say) -> int:
    """Node ``config.node_rank`` > 0: start this node's ranks and wait for them.

    Returns when they all exit (the engine core stopped them, or it is gone);
    if one fails the rest are stopped. SIGTERM / SIGINT stop them all.
    """
    from engine.loader.builder import checkpoint_fingerprint
    from engine.parallel.executor import start_worker, worker_specs

    specs = worker_specs(
        config, str(path), checkpoint_fingerprint(path), config.master_port, config.master_port + 1
    )
    procs = [start_worker(spec) for spec in specs]
    say(
        f"node {config.node_rank}: worker ranks {specs[0].rank}-{specs[-1].rank} of "
        f"{config.world_size}, engine core at {config.master_addr}:{config.master_port + 1}"
    )

    def stop(signum: int, frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return max(abs(c) for c in codes if c is not None)
            if any(c not in (None, 0) for c in codes):
                stop(0, None)
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop(0, None)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
