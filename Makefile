# Two commands for users: `make serve` and `make test`. Everything else is plumbing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOST    ?= 127.0.0.1
PORT    ?= 8000
MODEL   ?= tiny

.PHONY: setup serve test lint format clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: the CPU wheel on disk; an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(BIN)/flashserve serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: setup lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
