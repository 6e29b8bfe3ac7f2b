"""``flashserve serve``'s parallel-serving defaults under torchrun, and what a node other
than node 0 runs.

The flags themselves are ``EngineConfig``'s parallel fields (engine/config.py).

Node 0 runs the API and the engine core, which starts that node's worker ranks
itself (engine/parallel/executor.py). Every other node runs the same command with its
``--node-rank``: it starts its own ranks, which connect to node 0's engine core
(``--master-addr``, port ``--master-port`` + 1) and to torch.distributed
(``--master-port``), and serves no API. Defaults come from torchrun's
environment when it is set (one serve process per node: ``MASTER_ADDR``,
``MASTER_PORT``, ``NNODES`` or ``WORLD_SIZE``, ``NODE_RANK`` or ``RANK``).
"""

from __future__ import annotations

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


def torchrun_defaults() -> dict[str, Any]:
    """Defaults of the node flags (EngineConfig's parallel fields) from torchrun's
    environment, which names the node when serve runs once per node under it."""
    return {
        "nnodes": _env_int("NNODES", "WORLD_SIZE", default=1),
        "node_rank": _env_int("NODE_RANK", "RANK", default=0),
        "master_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "master_port": _env_int("MASTER_PORT", default=0),
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
