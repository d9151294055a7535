# daopsim front door. `make run` and `make test` install what they need on a bare machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
DAOPSIM := $(VENV)/bin/daopsim

.PHONY: install run test lint format bench notebooks notebook regress validate docs-validation clean \
	reference-coverage

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[capture,dask,dev,gym]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(DAOPSIM) run --policy daop --hw a6000-pcie4

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# lint, then every test (the notebooks are executed by tests/test_notebooks.py)
test: $(STAMP) lint
	$(PY) -m pytest
	$(DAOPSIM) regress --no-progress

notebooks: $(STAMP)
	$(PY) -m pytest tests/test_notebooks.py

# JupyterLab (the `notebook` extra) on the notebooks: run them yourself
notebook: $(STAMP)
	$(PIP) install -q -e ".[notebook]"
	$(VENV)/bin/jupyter lab notebooks/

bench: $(STAMP)
	$(PY) -m pytest tests/bench -m bench -q --override-ini addopts=

# how much of the fast engine's general path the reference-equivalence tests run (>= 95 %)
reference-coverage: $(STAMP)
	$(PY) tests/reference_coverage.py

regress: $(STAMP)
	$(DAOPSIM) regress

validate: $(STAMP)
	$(DAOPSIM) validate

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
