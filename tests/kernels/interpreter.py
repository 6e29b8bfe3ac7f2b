"""Triton's interpreter only takes effect if TRITON_INTERPRET=1 is set before Triton is
imported, so each kernel test file re-runs its Triton tests in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernels import dispatch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")


def run_triton_tests_in_child(test_file: str) -> None:
    """Run ``test_file``'s Triton tests with the interpreter on; fail if any fails or skips."""
    env = {k: v for k, v in os.environ.items() if k != dispatch.ENV_VAR}
    env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
    cmd += ["-k", "triton and not kernels_interpreted"]
    child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    print(child.stdout[-20000:], child.stderr[-5000:])
    assert child.returncode == 0, "interpreted Triton tests failed (output above)"
    assert " passed" in child.stdout and "skipped" not in child.stdout
