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
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast demo compile bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

# pytest exits 5 when it collected nothing: treat that as a failure so CI never passes vacuously.
test: setup
	@$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests were collected" >&2; exit 1; fi; exit $$rc

# Unit tests only (no multi-process training runs): the quick inner loop.
test-fast: setup
	$(PY) -m pytest -m "not multiprocess and not slow" $(PYTEST_ARGS)

demo: setup
	$(PY) -m pipelines.demo

clean:
	rm -rf $(VENV) runs .pytest_cache
