"""Start ``flashserve serve`` as a subprocess on a free loopback port and stop it again.

The server runs in a session of its own, so stopping it (SIGTERM, then SIGKILL
to that process group after a grace period) ends its workers with it and
nothing else. Each launched server gets a fresh, empty ``--kv-dir`` unless the
spec says no SSD tier, so runs never share cached pages.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
_MAIN = "import sys; from flashserve.cli import main; sys.exit(main(sys.argv[1:]))"


@dataclass(slots=True)
class ServerSpec:
    """How to start one server: ``flashserve serve --model MODEL [--kv-dir TMP] ARGS``."""

    model: str = "tiny"
    args: list[str] = field(default_factory=list)
    ssd: bool = True  # pass a fresh temporary --kv-dir
    # Run under a wrapper (``taskset -c 0`` pins a server to cores), with extra
    # environment (``OMP_NUM_THREADS``): bench/disagg.py splits cores this way.
    wrapper: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def command(self, port: int, kv_dir: Path | None) -> list[str]:
        cmd = [*self.wrapper, sys.executable, "-c", _MAIN, "serve", "--model", self.model]
        cmd += ["--host", HOST, "--port", str(port)]
        if kv_dir is not None:
            cmd += ["--kv-dir", str(kv_dir)]
        return cmd + self.args


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LaunchedServer:
    """``with LaunchedServer(spec, log) as server:`` -> ``server.base_url`` answers /health."""

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout_s: float = 600.0) -> None:
        self.spec = spec
        self.log_path = log_path
        self.startup_timeout_s = startup_timeout_s
        self.port = 0
        self.kv_dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.command: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        if self.spec.ssd:
            self.kv_dir = Path(tempfile.mkdtemp(prefix="flashserve-bench-kv-"))
        self.command = self.spec.command(self.port, self.kv_dir)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.update(self.spec.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode} before /health answered; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.25)
        raise TimeoutError(
            f"server did not answer /health within {self.startup_timeout_s:.0f} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server, SIGKILL its process group if it lingers; drop the kv dir."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if self.kv_dir is not None:
            shutil.rmtree(self.kv_dir, ignore_errors=True)
            self.kv_dir = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
