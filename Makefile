# Two commands do everything on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu
# Bytecode is cached (__pycache__/, ignored by git) even where the environment says not to: the suite starts
# hundreds of Python processes, each of which would otherwise compile the project's modules again (~0.3 s)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv venv-run demo test test-ci test-device test-all lint typecheck check clean bench chaos soak

# The virtual environment, created when it is missing and installed again when pyproject.toml changes. What
# runs the project (`make demo`, `make soak`) needs its server and trainer roles only, `.[server,trainer]`
# (~0.9 GB); `make test` and the other development targets add the dev tools on top, `.[dev]` (~1.3 GB in all).
comma := ,
define install
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[$(1)]' 2> >(grep -v "is ignored: it is neither" >&2)
endef

$(VENV)/.installed-run: pyproject.toml
	$(call install,server$(comma)trainer)
	touch $@

$(VENV)/.installed: pyproject.toml
	$(call install,dev)
	touch $@ $(VENV)/.installed-run

venv-run: $(VENV)/.installed-run
venv: $(VENV)/.installed

demo: venv-run
	$(PY) -m examples.demo

# Benchmarks against Orbax, the disk and a relaunch (BENCH_QUICK=1: the short form). Results go to bench-output/
# (untracked); BENCH_PUBLISH=1 writes the tracked bench/results*.json and the table in docs/benchmarks.md instead.
# BENCH_DEVICE=tpu (or JAX_PLATFORMS naming an accelerator, or jax finding one): the device profile instead, on one
# chip, into bench-output/results-device.json (docs/benchmarks.md, "The device profile of bench.run"); on the lent
# chip, which has no package index for the venv, `BENCH_DEVICE=tpu python3 -m bench.run` runs it directly.
bench: venv
	$(PY) -m bench.run

# Two workers by default (three gained 3% on this 2-core VM, 2026-12-03; docs/operations.md, "The test suites"). TEST_WORKERS=0 runs it in one process. Each test file stays on one worker (its module
# fixtures run once).
# `make test` leaves out the long runs (several processes or a benchmark family each: tests/support/long_runs.py);
# `make test-ci`, what CI runs (.ci/run), adds them; `make test-all` adds the tests marked slow as well.
TEST_WORKERS ?= 2
PYTEST_WORKERS = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: venv
	$(PY) -m pytest -q -m "not slow and not long" $(PYTEST_WORKERS)

test-ci: venv
	$(PY) -m pytest -q -m "not slow" $(PYTEST_WORKERS)

# The tests on one real accelerator (docs/operations.md, "Tests on an accelerator"): the runtime and checkpoint_io
# tests, the device benchmark's and any test marked `device`, in one process at a time (one process may hold the
# chip), the platform found by jax (JAX_PLATFORMS and XLA_FLAGS unset), CKPTD_TEST_DEVICE=1: ckptd and its clients
# on unix sockets, tests that need TCP or more devices than the chip has skipped with the reason. No venv is made:
# DEVICE_PY is the venv's Python where there is one, else python3 (the chip's deps are on PYTHONPATH).
DEVICE_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
# Test files elsewhere that mark a test `device` are found by name, not by collecting the whole suite: the chip's
# machine has the project's own dependencies, not every test's (aiohttp, kubernetes-validate, ...).
DEVICE_TESTS := tests/trainer/runtime tests/trainer/checkpoint_io tests/bench/test_bench_device.py
DEVICE_MARKED = $(filter-out $(addsuffix %,$(DEVICE_TESTS)),$(shell grep -rl --include='test_*.py' 'pytest.mark.device' tests))
# Each test's name and verdict as it ends (-v) and the slowest (--durations): a run cut short by the chip's time
# limit still says what passed, what failed and where it stopped.
test-device:
	env -u JAX_PLATFORMS -u XLA_FLAGS CKPTD_TEST_DEVICE=1 $(DEVICE_PY) -m pytest -v -rfE --durations=15 -p no:cacheprovider \
		-m "not slow" $(DEVICE_TESTS)
	$(if $(strip $(DEVICE_MARKED)),env -u JAX_PLATFORMS -u XLA_FLAGS CKPTD_TEST_DEVICE=1 $(DEVICE_PY) -m pytest -q \
		-p no:cacheprovider -m device $(DEVICE_MARKED),@echo "no test marked device outside $(DEVICE_TESTS)")

test-all: venv
	$(PY) -m pytest -q

# The recovery soak: SOAK_TRIALS elastic trials (default 100) in one trainer process, a slice lost inside JAX at a
# random phase of each (the replica snapshot's copy, two slices at once and a loss right after a regrow among
# them), each restore checked against the run's state at that step; prints the tables of docs/operations.md (the
# tier each recovery restored from, the steps lost) and writes soak-output/results.json (untracked;
# SOAK_PUBLISH=1: the tracked soak/results.json). SOAK_SEED=N replays (random: a new one).
soak: venv-run
	$(PY) -m soak

# Long forms of the chaos, load and storage-fault tests (CI runs their short forms in `make test`);
# CHAOS_SEED=N replays a run, CHAOS_SEED=random draws a new one.
chaos: venv
	$(PY) -m pytest -q -s -m chaos

lint: venv
	$(VENV)/bin/ruff check ckptd trainer_client examples tests bench soak

typecheck: venv
	$(VENV)/bin/mypy

check: lint typecheck test

clean:
	rm -rf demo-output bench-output soak-output maxtext-output quickstart-output .pytest_cache .mypy_cache .ruff_cache
