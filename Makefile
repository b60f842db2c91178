# taps_ray: `make demo` runs the main job on the embedded default, `make test` the whole suite.
# Each target installs what it needs first (a .venv with the pinned dependencies).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
STAMP := $(VENV)/.setup-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
DATA_DIR := $(abspath ../shared/data)
ifneq ($(wildcard $(DATA_DIR)/bench),)
export TAPS_DATA_DIR ?= $(DATA_DIR)
endif
export RAY_USAGE_STATS_ENABLED ?= 0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export TOKENIZERS_PARALLELISM ?= false

# Test processes (pytest-xdist, one test file per process at a time): one per core of the CI machine.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup test test-fast demo lint bench clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

# The peer engines of `taps bench --peer` (llama-cpp-python builds llama.cpp here: minutes, once).
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,bench]'
	@touch $(BENCH_STAMP)

test: setup $(BENCH_STAMP)
	@$(PY) -m pytest -q -ra --durations=15 $(XDIST); status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests: failing" >&2; fi; \
	exit $$status

# The pure unit tier (no embedded model, no Ray): under a minute.
test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(XDIST)

demo: setup
	$(VENV)/bin/taps demo configs/demo.yaml $(if $(filter full,$(DEMO)),--full)

lint: setup
	$(VENV)/bin/ruff check taps_ray tests benchmarks
	$(VENV)/bin/mypy

# The demo's math drafter when `make demo` has trained it, else an untrained one.
BENCH_DRAFTER ?= $(wildcard runs/demo/drafters/hass-math)

bench: setup
	$(PY) benchmarks/bench_decode.py configs/demo.yaml $(if $(BENCH_DRAFTER),--drafter $(BENCH_DRAFTER)) \
		--sweep --sweep-total 4,8,16 --sweep-depth 1,2,3

clean-venv:
	rm -rf $(VENV)
