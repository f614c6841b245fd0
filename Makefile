# One place for what CI and developers run. `make test` and `make demo` set up .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: venv system-deps test test-slow test-fast lint format bench demo clean

venv: $(STAMP)

# torch first, pinned: this exact version is a CPU build on local disk; anything looser may pull
# a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,examples]'
	touch $(STAMP)

# PostgreSQL for the tests that run the store on Postgres, Chromium for the dashboard's browser
# tests (Debian's packages; needs root).
system-deps:
	@missing=""; \
	command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="postgresql"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (apt-get) for the tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# Everything but the tests marked slow (the end-to-end runs and the reliability drills), which
# `make test-slow` runs; CI runs both.
test: venv system-deps
	$(PY) -m pytest -q -m "not slow" --durations=15

test-slow: venv system-deps
	$(PY) -m pytest -q -m slow --durations=15

# The pure unit tests and the in-process API tier (the app over ASGI, real SQLite, the real
# engine in threads): no process started, under a minute on two cores.
test-fast: venv
	$(PY) -m pytest -q -m "not slow" -n 2 --durations=10 tests/unit tests/api

lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: venv
	$(PY) bench/engine.py
	$(PY) bench/proxy.py
	$(PY) bench/trainer.py
	$(PY) bench/dashboard.py
	$(PY) bench/export.py
	$(PY) bench/async_vs_sync.py
	$(PY) bench/staleness_ablation.py

demo: venv
	$(VENV)/bin/proxrl demo

# The documentation site: the reference pages (docs/reference/) regenerated from the code first
# (tests/unit/test_docs_reference.py fails while a committed one is stale), then built strictly
# into site/.
.PHONY: docs
docs: venv
	$(PY) -m tools.docs_reference
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
