# daopsim front door. `make run` and `make test` install what they need on a bare machine.
#   make run      the base package (no extras, no compiler), then the main job
#   make native   compile the engine core and the policies (mypyc; needs a C compiler)
#   make test     everything the tests need (extras, torch, dev tools), compiled, then the tests
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
DAOPSIM := $(VENV)/bin/daopsim
# stamps: the base package (editable, uncompiled), the build tools, every extra, the compiled build
BASE   := $(VENV)/.base
TOOLS  := $(VENV)/.tools
FULL   := $(VENV)/.full
NATIVE := $(VENV)/.native
# the compiled modules' sources (simulator/native.py): a new policy file is one of them
NATIVE_SOURCES := setup.py pyproject.toml simulator/native.py simulator/boundary.py \
	simulator/heap.py $(wildcard simulator/core/*.py) $(wildcard policies/*.py)
# tests run on both cores: pytest-xdist spreads them over the cores; the C compiler too
JOBS ?= 2
.PHONY: install native run test lint format typecheck bench notebooks notebook regress validate \
	docs-validation docs-metrics clean reference-coverage

# the base package only: simpy, numpy, pandas, pyarrow, matplotlib, click (pyproject.toml);
# setuptools in the venv so that no isolated build environment is made for the editable install
$(BASE): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q "setuptools>=77"
	DAOPSIM_PURE_PYTHON=1 $(PIP) install -q --no-build-isolation -e .
	touch $@

# mypy (mypyc) at the version pyproject.toml's build requirements name
$(TOOLS): $(BASE)
	$(PIP) install -q $$($(PY) -c "import tomllib; \
		print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires']))")
	touch $@

# torch is pinned: an unpinned torch pulls a multi-GB CUDA build. After the build tools, so that
# no two pip runs share the venv when it is made at the same time as the compiled build (install)
$(FULL): $(TOOLS) pyproject.toml
	$(PIP) install -q "torch==2.13.0"
	DAOPSIM_PURE_PYTHON=1 $(PIP) install -q --no-build-isolation -e ".[capture,dask,dev,gym]"
	touch $@

# every extra and the compiled build, at the same time: pip installs on about one core while the
# C compiler has both (a sub-make: -j whatever make was called with)
install:
	$(MAKE) --no-print-directory -j $(JOBS) $(FULL) $(NATIVE)

# compiles each module of simulator/native.py's list beside its source, in parallel, with a line
# per module; only what changed (and what imports it) is rebuilt. Without a C compiler it
# leaves the pure-Python package as it is.
$(NATIVE): $(TOOLS) $(NATIVE_SOURCES)
	$(PY) setup.py -q build_ext --inplace -j $(JOBS)
	touch $@

native: $(NATIVE)

# the main job on the base package; compiled when `make native` has run
run: $(BASE)
	$(DAOPSIM) run --policy daop --hw a6000-pcie4
	@test -f $(NATIVE) || echo "daopsim ran interpreted: \`make native\` compiles the engine core and the policies (2-4x faster; a C compiler, about a minute on 2 cores)"

lint: $(FULL)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(FULL)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# mypy on the compiled modules, in a copy laid out as installed (pyproject.toml, [tool.mypy]);
# paths are printed as the repository's
typecheck: $(TOOLS)
	$(PY) simulator/native.py stage build/stage >/dev/null
	$(VENV)/bin/mypy | sed -e 's#^build/stage/daopsim/\(simulator\|policies\)/#\1/#'

# lint, then every test on the compiled build, then the tests that patch the core's classes on
# the interpreted core (marker `pure`). The golden store is checked whole by tests/test_golden.py
# (`daopsim regress` is the same check from the command line). The notebooks are executed by
# tests/test_notebooks.py. Tests that time this machine (marker `measure`: the closed loop) run
# last, alone, so that no other test shares the cores with what they measure.
# The second and third passes collect only the files that use their marker (tests/conftest.py
# fails a run in which a test carries the marker in another file): collecting all of tests/ costs
# each process about 10 CPU-seconds, more than the pure pass's 43 tests. Byte-code is written
# (PYTHONDONTWRITEBYTECODE unset for the passes): otherwise every process, and every `daopsim`
# a test starts, compiles the package's sources and rewrites the test modules' asserts afresh.
# worksteal: an idle worker takes queued tests from the other, so both finish together.
PURE_TESTS := $(shell grep -l "mark\.pure" tests/test_*.py)
MEASURE_TESTS := $(shell grep -l "mark\.measure" tests/test_*.py)
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest
test: install
	$(MAKE) --no-print-directory lint
	$(PYTEST) -n $(JOBS) --dist worksteal -m "not bench and not measure"
	DAOPSIM_PURE_PYTHON=1 $(PYTEST) -p no:xdist -m "pure and not bench" $(PURE_TESTS)
	$(PYTEST) -p no:xdist -m "measure and not bench" $(MEASURE_TESTS)

notebooks: $(FULL)
	$(PY) -m pytest tests/test_notebooks.py

# JupyterLab (the `notebook` extra) on the notebooks: run them yourself
notebook: $(FULL)
	DAOPSIM_PURE_PYTHON=1 $(PIP) install -q --no-build-isolation -e ".[notebook]"
	$(VENV)/bin/jupyter lab notebooks/

bench: $(FULL) $(NATIVE)
	$(PY) -m pytest tests/bench -m bench -q --override-ini addopts=

# how much of the engine core the reference-equivalence tests run (>= 99 %; the interpreted
# core, since a compiled one reports no lines)
# the generated tables of the docs: docs/metrics.md's from the metric registry
# (simulator/metrics.py), docs/sweeps.md's grid keys from the run declaration
# (simulator/run_params.py)
docs-metrics: $(BASE)
	$(PY) -m daopsim.simulator.doc_tables

reference-coverage: $(FULL)
	DAOPSIM_PURE_PYTHON=1 $(PY) tests/reference_coverage.py

regress: $(BASE)
	$(DAOPSIM) regress

validate: $(BASE)
	$(DAOPSIM) validate

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache simulator/native-build.json
	find simulator policies -name '*.so' -delete
