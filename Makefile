# kvlab: the two commands of the README, plus the heavy tests and the benchmarks.
# Every target sets up (or refreshes) .venv first; `parity` uses its own venv (experiments/kvpress_parity).
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE ?= 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup run test test-unit test-heavy bench bench-kernels parity

setup:
	@bash scripts/setup_env.sh

run: setup  ## the default experiment: SmolLM2-135M, quality + throughput
	$(PY) -m kvlab $(ARGS)

TEST_WORKERS ?= 2
test: setup  ## the test suite (under ~15 minutes on 2 CPU cores; a worker per core, a test file per worker)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-unit: setup  ## the default suite without the tests that start other processes (pip, notebooks, sweeps)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not heavy and not process" $(ARGS)

test-heavy: setup  ## the slow cases (full benchmark smoke runs, large sweeps)
	$(PY) -m pytest -q -m heavy $(ARGS)

bench: setup  ## throughput vs Hugging Face generate / generate_batch on the Azure trace
	$(PY) experiments/bench_throughput.py $(ARGS)

bench-kernels: setup  ## kernel checks and timings (needs a CUDA GPU for the timings)
	$(PY) -m kvlab.kernels.bench $(ARGS)

parity:  ## kvpress 0.5.5 reference outputs for policy parity (own venv; not part of `make test`)
	@bash experiments/kvpress_parity/make_venv.sh
	experiments/kvpress_parity/.venv/bin/python experiments/kvpress_parity/kvpress_reference.py $(ARGS)
