# daopsim front door. `make run` and `make test` install what they need on a bare machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DAOPSIM := $(VENV)/bin/daopsim
# the compiled engine core (mypyc, simulator/native.py): rebuilt when a compiled source changes
NATIVE := $(VENV)/.native
NATIVE_SOURCES := setup.py simulator/native.py simulator/boundary.py simulator/heap.py $(wildcard simulator/core/*.py) $(wildcard policies/*.py)
# tests run on both cores: pytest-xdist spreads them over the cores
JOBS ?= 2

.PHONY: install native run test lint format bench notebooks notebook regress validate docs-validation \
	clean reference-coverage

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PIP) install -q "torch==2.13.0"
	# uncompiled here; $(NATIVE) compiles once, with the mypy this installs
	DAOPSIM_PURE_PYTHON=1 $(PIP) install -q -e ".[capture,dask,dev,gym]"
	touch $(STAMP)

install: $(NATIVE)

# compiles the engine core and the policies in place (falls back to pure Python without a C
# compiler); `install` does it once, this redoes it after their sources change
$(NATIVE): $(STAMP) $(NATIVE_SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $(NATIVE)

native: $(NATIVE)

run: $(NATIVE)
	$(DAOPSIM) run --policy daop --hw a6000-pcie4

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# lint, then every test on the installed (compiled) core, then the tests that patch the core's
# classes on the interpreted core (marker `pure`), then the golden store. The notebooks are
# executed by tests/test_notebooks.py.
test: $(NATIVE) lint
	$(PY) -m pytest -n $(JOBS)
	DAOPSIM_PURE_PYTHON=1 $(PY) -m pytest -n $(JOBS) -m "pure and not bench"
	$(DAOPSIM) regress --no-progress

notebooks: $(STAMP)
	$(PY) -m pytest tests/test_notebooks.py

# JupyterLab (the `notebook` extra) on the notebooks: run them yourself
notebook: $(STAMP)
	$(PIP) install -q -e ".[notebook]"
	$(VENV)/bin/jupyter lab notebooks/

bench: $(NATIVE)
	$(PY) -m pytest tests/bench -m bench -q --override-ini addopts=

# how much of the engine core the reference-equivalence tests run (>= 95 %; the interpreted
# core, since a compiled one reports no lines)
reference-coverage: $(STAMP)
	DAOPSIM_PURE_PYTHON=1 $(PY) tests/reference_coverage.py

regress: $(NATIVE)
	$(DAOPSIM) regress

validate: $(STAMP)
	$(DAOPSIM) validate

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
