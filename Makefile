# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu

.PHONY: venv demo test test-all lint typecheck check clean

# The virtual environment, with the project and its dev tools installed (re-made when pyproject changes).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]' 2> >(grep -v "is ignored: it is neither" >&2)
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m examples.demo

test: venv
	$(PY) -m pytest -q -m "not slow"

test-all: venv
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check ckptd trainer_client examples tests
	$(VENV)/bin/ruff format --check ckptd trainer_client examples tests

typecheck: venv
	$(VENV)/bin/mypy

check: lint typecheck test

clean:
	rm -rf demo-output .pytest_cache .mypy_cache .ruff_cache
