# Two commands on a fresh machine: `make run` and `make test` (both set up .venv first).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU-only machines get the CPU build of torch (a plain `torch` would pull a multi-GB CUDA build).
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST_ARGS ?=
# Test files run on two workers (pytest-xdist), a file's tests together on one: much of the
# suite waits on servers and subprocesses. OMP_WAIT_POLICY=passive: a worker's idle OpenMP
# threads sleep instead of spinning on the core the other worker needs.
PYTEST_WORKERS ?= 2

.PHONY: setup run test bench bench-peers proto lint clean loadtest bench-serving scenarios soak replicas \
	gpu-check gpu-wheels eval

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: setup
	$(BIN)/moeserve serve $(if $(MODEL),--model $(MODEL),)

# The style check runs first: a formatting slip fails `make test` (and CI) like a test would.
test: setup lint
	OMP_WAIT_POLICY=passive $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m bench.engine_bench
	$(BIN)/python -m bench.engine_bench --arch all
	$(BIN)/python -m bench.family_bench
	$(BIN)/python -m bench.long_context_bench
	$(BIN)/python -m bench.moe_kernel_bench
	$(BIN)/python -m bench.engine_bench --smollm2
	$(BIN)/python -m bench.serving_bench
	$(BIN)/python -m bench.telemetry_bench
	$(BIN)/python -m bench.telemetry_bench --compare inspector
	$(BIN)/python -m bench.kv_events_bench
	$(BIN)/python -m bench.spec_bench
	$(BIN)/python -m bench.scoring_bench
	$(BIN)/python -m bench.replicas_bench
	$(BIN)/python -m bench.structured_bench
	$(BIN)/python -m bench.quant_bench
	$(BIN)/python -m bench.access_bench

# lm-evaluation-harness over the local task pack (bench/eval_pack.py), through the API per model
# and format, beside transformers' run of each checkpoint: bench/results/eval.json (no timing)
eval: setup
	$(BIN)/python -m bench.eval_bench

# REPLICAS local replicas (default 2), each pinned to its share of the cores, behind vLLM's
# router on port 8000 (bench/replicas.py; POLICY: cache_aware, kv_aware, power_of_two...).
REPLICAS ?= 2
POLICY   ?= cache_aware
replicas: setup
	$(BIN)/python -m bench.replicas --replicas $(REPLICAS) --policy $(POLICY) \
		$(if $(MODEL),--model $(MODEL),)

# Peer benchmark (not part of `make test` or CI): sets up vLLM and llama.cpp once under
# ~/.cache/moeserve/peers (tens of minutes), then measures; later runs reuse the peers.
bench-peers: setup
	bash bench/peers/setup_peers.sh
	$(BIN)/python -m bench.peers.run_peers $(PEERS_ARGS)

# Fault scenarios (bench/scenarios, notes in bench/NOTES.md): a real server, Debian's
# prometheus + prometheus-alertmanager (apt-get install prometheus prometheus-alertmanager)
# and the anomaly webhook; one fault per scenario; rows and the webhook's F1 in
# bench/results/scenarios.json. About 25 minutes. `make test` runs a CI subset
# (tests/scenarios). `make soak`: 30 minutes at 80% of capacity (not in CI).
SCENARIOS_ARGS ?=
scenarios: setup
	$(BIN)/python -m bench.scenarios $(SCENARIOS_ARGS)

soak: setup
	$(BIN)/python -m bench.scenarios --only soak $(SCENARIOS_ARGS)

# The GPU check (issue 21; bench/gpu_check.sh): run on the lent GPU machine, whose image has
# torch and no network, so no set-up here; .whl/ carries our other dependencies, filled first
# by `make gpu-wheels` where there is network. `make gpu-check GPU_CHECK_ARGS=--cpu-dry-run`
# runs the same stages on the CPU with a tiny model (no GPU figure).
GPU_CHECK_ARGS ?=
gpu-check:
	bash bench/gpu_check.sh $(GPU_CHECK_ARGS)

gpu-wheels: setup
	$(BIN)/python -m bench.gpu_wheels download

proto: setup
	$(BIN)/python -m service.proto.generate

# --- load tests (loadtest/) -------------------------------------------------------------
LOADTEST_HOST  ?= http://127.0.0.1:8000
LOADTEST_USERS ?= 8
LOADTEST_TIME  ?= 60s
LOADTEST_STAMP := $(shell date +%Y%m%d-%H%M%S)
LOADTEST_OUT   ?= loadtest/results/locust-$(LOADTEST_STAMP)
LOADTEST_ARGS  ?=
ARGS ?=

# Headless Locust against a running server (REST: LOADTEST_HOST; gRPC: MOESERVE_GRPC_TARGET,
# default <host>:50051) for LOADTEST_TIME; CSV + HTML reports in LOADTEST_OUT.
loadtest: setup
	mkdir -p $(LOADTEST_OUT)
	$(BIN)/locust -f loadtest/locustfile.py --headless -u $(LOADTEST_USERS) -r $(LOADTEST_USERS) \
		-t $(LOADTEST_TIME) --stop-timeout 30 --host $(LOADTEST_HOST) \
		--csv $(LOADTEST_OUT)/locust --html $(LOADTEST_OUT)/report.html \
		--request-log $(LOADTEST_OUT)/requests.csv --only-summary $(LOADTEST_ARGS)
	@echo "reports in $(LOADTEST_OUT)"

# Serving benchmark against any OpenAI-compatible endpoint, e.g.
#   make bench-serving ARGS="--max-concurrency 4 --num-prompts 64 --ignore-eos"
bench-serving: setup
	$(BIN)/python loadtest/bench_serving.py $(ARGS)

lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache
