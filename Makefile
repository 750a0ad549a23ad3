# lightning_par3d — run `make help` for the targets.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a GPU machine installs the CUDA build first (see README) and sets TORCH= to skip this.
TORCH ?= torch==2.13.0
DEVICES ?= 4

.DEFAULT_GOAL := help
.PHONY: help setup demo accelerate test test-quick lint docs bench clean

help:  ## Show this help.
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  \033[36m%-8s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) not found: set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q $(TORCH))
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed  ## Create .venv with the package, CPU torch and the dev tools.

demo: setup  ## Train the bundled GPT with par3d in full 3D (dp=2 x tp=2 x pp=2) on 8 CPU processes.
	$(PY) examples/train.py experiment=demo

accelerate: setup  ## The Accelerate example: the GPT at dp_shard=2 x tp=2 on 4 CPU processes (accelerate launch).
	$(VENV)/bin/accelerate launch --config_file conf/accelerate/cpu4.yaml examples/accelerate_train.py strategy.tp=2

test: setup  ## The whole test suite, what CI runs (17 to 22 minutes on 2 cores; see docs/development.md).
	$(PY) -m pytest

test-quick: setup  ## The inner loop: no process pool or new interpreter, plus one parity case per parallelism (< 5 min).
	$(PY) -m pytest -m quick

lint: setup  ## ruff, ruff format --check, mypy, the layers (import-linter) and the docs (warnings as errors).
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

docs: setup  ## Build the docs site into docs/_build/html (Sphinx, MyST, autodoc).
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

bench: setup  ## Benchmarks: par3d against Lightning's and Accelerate's own; the pipeline bubble; ZeRO; callbacks' cost; planning time.
	$(PY) benchmarks/bench_strategies.py
	$(PY) benchmarks/bench_accelerate.py
	$(PY) benchmarks/bench_pipeline_bubble.py
	$(PY) benchmarks/bench_zero.py
	$(PY) benchmarks/bench_callbacks.py
	$(PY) benchmarks/bench_plan_scale.py

clean:  ## Remove the virtual environment and run outputs.
	rm -rf $(VENV) outputs multirun lightning_logs smoke docs/_build .pytest_cache .mypy_cache .ruff_cache
