"""The import contracts of pyproject.toml hold on the tree, and break on a wrong import.

`make lint` runs `lint-imports`; these tests check that the contracts are kept
today and that each one is live: a copy of the packages with one deliberately
wrong import fails, naming the contract it breaks and the offending import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _config() -> dict:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]


def _contract_names() -> dict[str, str]:
    return {c["id"]: c["name"] for c in _config()["contracts"]}


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on the packages under `root`, and only those."""
    env = dict(os.environ, PYTHONPATH=str(root), COLUMNS="400", NO_COLOR="1")
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _status_lines(output: str) -> dict[str, str]:
    """Contract name -> KEPT or BROKEN, from lint-imports' summary lines."""
    status = {}
    for name in _contract_names().values():
        for line in output.splitlines():
            if line.startswith(name + " "):
                status[name] = "BROKEN" if "BROKEN" in line else "KEPT"
    return status


def test_contracts_hold_on_the_tree() -> None:
    result = _lint_imports(ROOT)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    status = _status_lines(out)
    assert status == dict.fromkeys(_contract_names().values(), "KEPT"), out


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The root packages and pyproject.toml, copied once for the broken-import cases."""
    dst = tmp_path_factory.mktemp("tree")
    shutil.copy2(PYPROJECT, dst / "pyproject.toml")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "data", "results")
    for package in _config()["root_packages"]:
        shutil.copytree(ROOT / package, dst / package, ignore=ignore)
    return dst


# (module file, the wrong import appended to it, the contract it breaks, the import
# lint-imports must name)
WRONG_IMPORTS = [
    ("kvstore/manager.py", "import server.app", "layers", "kvstore.manager -> server.app"),
    (
        "server/openai/serving_chat.py",
        "import engine.core.llm_engine",
        "server-engine-api",
        "server.openai.serving_chat -> engine.core.llm_engine",
    ),
    (
        "engine/model/deepseek_v41/model.py",
        "import engine.runner.model_runner",
        "model-storage",
        "engine.model.deepseek_v41.model -> engine.runner.model_runner",
    ),
    (
        "engine/core/scheduler.py",
        "import kvstore.ssd.persistent",
        "kvstore-ssd-behind-manager",
        "engine.core.scheduler -> kvstore.ssd.persistent",
    ),
    (
        "engine/runner/model_runner.py",
        "import kernels.triton.gather_kv",
        "triton-behind-ops",
        "engine.runner.model_runner -> kernels.triton.gather_kv",
    ),
]


@pytest.mark.parametrize(
    ("module", "statement", "contract", "named"), WRONG_IMPORTS, ids=[w[2] for w in WRONG_IMPORTS]
)
def test_a_wrong_import_breaks_its_contract(
    tree_copy: Path, module: str, statement: str, contract: str, named: str
) -> None:
    path = tree_copy / module
    original = path.read_text()
    path.write_text(original + f"\n{statement}  # deliberately wrong\n")
    try:
        result = _lint_imports(tree_copy)
    finally:
        path.write_text(original)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    broken = {name for name, s in _status_lines(out).items() if s == "BROKEN"}
    assert broken == {_contract_names()[contract]}, out
    assert named in out, out


def test_every_contract_has_a_wrong_import_case() -> None:
    """A contract added to pyproject.toml gets a case above that breaks it."""
    assert {w[2] for w in WRONG_IMPORTS} == set(_contract_names())
