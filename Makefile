# Two commands for users: `make serve` and `make test`. Everything else is plumbing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOST    ?= 127.0.0.1
PORT    ?= 8000
MODEL   ?= demo

.PHONY: setup serve test lint lint-deploy format clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: the CPU wheel on disk; an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

# System tools from Debian, when missing: promtool and docker-compose for lint-deploy,
# chromium for the playground's browser tests (scripts/install_tools.sh); the coding
# agents of tests/agents/ (OpenCode, Claude Code), from npm, into .agents/.
setup: $(STAMP)
	@scripts/install_tools.sh --if-possible
	@scripts/install_agents.sh --if-possible

serve: setup
	$(BIN)/flashserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

# Static types too (mypy, configured in pyproject.toml: engine, kvstore, kernels,
# server, training), and the import layering of docs/design/architecture.md
# (lint-imports: the contracts in pyproject.toml's [tool.importlinter]).
lint: setup lint-deploy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Dockerfiles, compose, kustomize overlays, alert rules (scripts/lint_deploy.sh).
lint-deploy: setup
	scripts/lint_deploy.sh

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Two pytest workers (pytest-xdist), a test file each at a time: the suite is
# mostly single-threaded processes (servers, gloo ranks, interpreted kernels), so
# two files at once use both cores; `--dist loadfile` keeps a file's module- and
# session-scoped servers in one worker. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30

# A small agent workload on the tiny model over HTTP, server launched on a free
# loopback port (bench/serving/; results in bench/results/serving/).
.PHONY: bench
# The bench stays on the tiny model: it measures serving, not text.
BENCH_MODEL ?= tiny
BENCH_ARGS ?= --workload agent --num-agents 8 --turns 6 --system-len 2048 --tool-result-len 512 --output-len 16 --request-rate 1
bench: setup
	$(BIN)/flashserve bench --launch --launch-model $(BENCH_MODEL) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
