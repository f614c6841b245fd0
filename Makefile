# One place for what CI and developers run. `make test` and `make demo` set up .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv test test-fast lint format bench demo clean

venv: $(STAMP)

# torch first, pinned: this exact version is a CPU build on local disk; anything looser may pull
# a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q tests/unit

lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: venv
	$(PY) bench/engine.py

demo: venv
	$(PY) examples/engine_demo.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
