# Two commands on a fresh machine: `make run` and `make test` (both set up .venv first).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU-only machines get the CPU build of torch (a plain `torch` would pull a multi-GB CUDA build).
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: setup run test bench proto lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: setup
	$(BIN)/moeserve serve $(if $(MODEL),--model $(MODEL),)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench.engine_bench

proto: setup
	$(BIN)/python -m service.proto.generate

lint: setup
	$(BIN)/ruff check inference service telemetry tests bench loadtest

clean:
	rm -rf $(VENV) .pytest_cache
