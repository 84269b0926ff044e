# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it needs into .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default so a fresh machine never pulls a multi-GB CUDA build by accident.
# On a CUDA host: make setup TORCH_SPEC='torch==2.13.0' TORCH_INDEX='--index-url https://download.pytorch.org/whl/cu130'
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# Each part lists its slowest tests: where the suite's time goes, on every run and in CI's log.
DURATIONS ?= --durations=12
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo compile bench clean

setup: $(STAMP)

# Through uv, which pip puts into the venv (a fresh install ~45 s faster than pip's; compiled as pip does: with
# PYTHONDONTWRITEBYTECODE set, an uncompiled install makes every test process compile torch from source). uv reads
# no pip configuration: pip's find-links from the environment are passed on (where a machine keeps its torch
# builds). Where uv cannot be installed or fails, pip installs everything as before.
UV := $(VENV)/bin/uv
UV_INSTALL = $(UV) pip install -q --python $(PY) --compile-bytecode $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -m pip install -q uv && $(UV_INSTALL) $(TORCH_INDEX) "$(TORCH_SPEC)" && $(UV_INSTALL) -e ".[dev]"; \
	then echo "make setup: installed with uv"; else echo "make setup: uv unavailable or failed; pip installs" >&2; \
		$(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)" && \
		$(PY) -m pip install -q -e ".[dev]"; fi
	@touch $@

# Three pytest runs: the single-process tests on TEST_WORKERS pytest-xdist workers; the `multiprocess` ones
# (torchrun/ft_launcher runs, kfp.local pipelines) MULTI_WORKERS at a time, a test module per worker (its shared
# runs are made once; the longest first, tests/conftest.py); then the `serial` ones alone, whose timing margins
# need the cores to themselves. Every exit code counts. pytest exits 5 when it collected nothing: a failure, so
# CI never passes vacuously (with PYTEST_ARGS naming tests, some parts may collect none).
# Two more workers than CPUs: much of the single-process tests' time is waiting (stub API servers and the launcher's
# polls against them, checkpoint writer processes), which spare workers fill, the longest tests first
# (tests/conftest.py). On 2 cores, 3 to 6 workers take the part alone within the machine's run-to-run noise of each
# other; 4 is as fast as any.
TEST_WORKERS ?= $(shell echo $$(($$(nproc) + 2)))
MULTI_WORKERS ?= 2
# Bytecode is written even where the environment sets PYTHONDONTWRITEBYTECODE: every collecting pytest process
# and every launched trainer, writer and pipeline step would otherwise compile the project's modules (and pytest
# rewrite each test module) from source again (a third of the single-process tests' collection).
test: setup
	@unset PYTHONDONTWRITEBYTECODE; t0=$$(date +%s); \
	$(PY) -m pytest -m "not multiprocess" -n $(TEST_WORKERS) $(DURATIONS) $(PYTEST_ARGS); single=$$?; t1=$$(date +%s); \
	$(PY) -m pytest -m "multiprocess and not serial" -n $(MULTI_WORKERS) --dist loadscope \
		--no-loadscope-reorder $(DURATIONS) $(PYTEST_ARGS); multi=$$?; \
	t2=$$(date +%s); \
	$(PY) -m pytest -m "multiprocess and serial" $(DURATIONS) $(PYTEST_ARGS); serial=$$?; t3=$$(date +%s); \
	echo "make test: single-process tests $$((t1 - t0)) s (xdist -n $(TEST_WORKERS), exit $$single)," \
		"multi-process tests $$((t2 - t1)) s (xdist -n $(MULTI_WORKERS), exit $$multi)" \
		"+ $$((t3 - t2)) s one at a time (exit $$serial)"; \
	if [ $$single -eq 5 -a $$multi -eq 5 -a $$serial -eq 5 ] || \
		{ [ -z "$(PYTEST_ARGS)" ] && [ $$single -eq 5 -o $$multi -eq 5 -o $$serial -eq 5 ]; }; then \
		echo "make test: no tests were collected" >&2; exit 1; fi; \
	for rc in $$single $$multi $$serial; do [ $$rc -eq 0 -o $$rc -eq 5 ] || exit $$rc; done

# Unit tests only (no multi-process training runs): the quick inner loop.
test-fast: setup
	$(PY) -m pytest -m "not multiprocess and not slow" $(PYTEST_ARGS)

demo: setup
	$(PY) -m pipelines.demo

# The cluster pipeline for one image: make compile IMAGE=registry.example.com/you/resilient-train:TAG
# [PULL_SECRET=regcred] [PIPELINE=pipeline.yaml]. The YAML is stamped with this checkout's version, which the
# image must carry too (docker build --build-arg VERSION="$$(python -m pipelines.compile --print-version)").
IMAGE ?=
PULL_SECRET ?=
PIPELINE ?= pipeline.yaml
compile: setup
	@test -n "$(IMAGE)" || { echo "make compile: set IMAGE=REGISTRY/resilient-train:TAG, the image you built and pushed" >&2; exit 2; }
	$(PY) -m pipelines.compile --image "$(IMAGE)" $(if $(PULL_SECRET),--image-pull-secret "$(PULL_SECRET)") --out "$(PIPELINE)"

# The CPU rows of BENCHMARKS.md, "Snapshot cost". The GPU figures come from bench/gpu_suite.sh and
# bench/throughput_suite.sh on a CUDA host (docs/benchmarks.md).
bench: setup
	PYTHONPATH=.:trainer_image OMP_NUM_THREADS=2 $(PY) bench/checkpoint_bench.py --config tiny \
		--steps 20 --every 5 --persist-every 2 --model.vocab_size=2048

clean:
	rm -rf $(VENV) runs .pytest_cache
