"""The engine core in its own process (``EngineCoreClient``) alone: a killed core fails
its streams and refuses new requests; a graceful shutdown lets the core exit by itself
and removes the socket files; a core whose API process vanished exits on its own. What
it shares with the in-process client is tested once for both in test_engine_client.py."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.api.core_client import EngineCoreClient
from engine.api.errors import EngineDeadError
from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig

CONFIG = EngineConfig(
    max_num_seqs=4, page_tokens=16, kv_cache_bytes=4 << 20, max_model_len=256, dtype="float64"
)
TIMEOUT_S = 60.0


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def run_all(engine, reqs: list[Request]) -> dict[str, list]:
    async def one(r: Request) -> list:
        return [out async for out in engine.generate(r)]

    outs = await asyncio.wait_for(asyncio.gather(*(one(r) for r in reqs)), TIMEOUT_S)
    return {r.request_id: o for r, o in zip(reqs, outs, strict=True)}


async def wait_for(predicate, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_a_killed_core_fails_streams_and_refuses_new_requests():
    client = EngineCoreClient(CONFIG, "tiny", torch_threads=1)
    sockets = client.socket_dir
    assert sockets.is_dir()

    async def main():
        outs: list = []

        async def consume() -> None:
            gen = client.generate(Request("k", [0, 7, 8], params(10_000, ignore_eos=True)))
            async for out in gen:
                outs.append(out)

        task = asyncio.create_task(consume())
        await wait_for(lambda: bool(outs))
        os.kill(client.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited"):
            await asyncio.wait_for(task, 10.0)
        assert not client.is_running
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(run_all(client, [Request("n", [0, 5], params(1))]), 5.0)

    try:
        asyncio.run(main())
    finally:
        started = time.monotonic()
        client.shutdown(timeout=10)
        assert time.monotonic() - started < 10
    assert not sockets.exists()


def test_graceful_shutdown_ends_streams_stops_the_core_and_removes_sockets():
    core = EngineCoreClient(CONFIG, "tiny", torch_threads=1)
    sockets, proc = core.socket_dir, core._proc

    async def main():
        outs: list = []

        async def consume() -> None:
            gen = core.generate(Request("s", [0, 7, 8], params(10_000, ignore_eos=True)))
            async for out in gen:
                outs.append(out)

        task = asyncio.create_task(consume())
        await wait_for(lambda: bool(outs))
        await asyncio.to_thread(core.shutdown, 30)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, 10.0)

    asyncio.run(main())
    assert proc.exitcode == 0  # it left by itself (ShutdownMsg), not killed
    assert not sockets.exists()
    assert proc not in multiprocessing.active_children()
    assert not core.is_running


_ORPHAN = """
import sys, time
from engine.api.core_client import EngineCoreClient
from engine.config import EngineConfig
c = EngineCoreClient(EngineConfig(page_tokens=16, kv_cache_bytes=4 << 20), "tiny", torch_threads=1)
print(c.pid, c.socket_dir, flush=True)
time.sleep(600)
"""


def test_a_core_whose_api_process_vanished_exits_and_removes_the_sockets():
    api = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, text=True)
    try:
        assert api.stdout is not None
        pid_text, sockets_text = api.stdout.readline().split()
        pid, sockets = int(pid_text), Path(sockets_text)
        assert sockets.is_dir()
        api.kill()  # SIGKILL: it cannot tell the core
        api.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (_alive(pid) or sockets.exists()):
            time.sleep(0.1)
        assert not _alive(pid) and not sockets.exists()
    finally:
        api.kill()


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
