# One place for what CI and developers run. `make test` and `make demo` set up .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LOCK := requirements/lock.txt
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# mkdocs-material prints a banner about MkDocs 2.0 on every build; the docs build on MkDocs 1.6.
export NO_MKDOCS_2_WARNING := 1

.PHONY: venv system-deps test test-slow test-fast lint hooks format bench demo demo-lora clean

venv: $(STAMP)

# The lock pins every package, torch included (the CPU build of its release), so the
# venv is exactly the lock: --no-deps resolves nothing anew (nothing else, no CUDA torch, can be
# pulled in), pip-sync removes what the lock no longer holds, pip check proves it consistent.
$(STAMP): $(LOCK) pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-deps -r $(LOCK)
	$(VENV)/bin/pip-sync --quiet --python-executable $(PY) $(LOCK)
	$(PY) -m pip install --quiet --no-deps -e .
	$(PY) -m pip check
	touch $(STAMP)

# ----- the lock --------------------------------------------------------------------------------
# requirements/lock.txt: the dev extra resolved by pip-compile (pip's resolver and this machine's
# pip.conf) for Linux x86_64, CPython 3.11. pip-tools runs from a venv of its own, so that a
# pyproject.toml change can be locked before .venv can be built from it.
LOCK_TOOLS := $(VENV)/.lock-tools
UPGRADE_DIR := $(VENV)/.upgrade
PIP_COMPILE = $(LOCK_TOOLS)/bin/pip-compile --quiet --no-header --annotation-style=line \
	--allow-unsafe --strip-extras --no-emit-index-url --no-emit-find-links --extra dev
FINISH_LOCK := $(PYTHON) requirements/lockfile.py
# torch stays at the lock's release through `make upgrade`: PyPI's newer torch is a multi-GB CUDA
# build. To move it, place the CPU wheel and run `make upgrade TORCH=torch==X.Y.Z`.
TORCH = $(shell grep -Eo '^torch==[^ ]+' $(LOCK))
# The fast suite (`make test-fast`, and `make upgrade` against its scratch venv): the pure unit
# tests and the in-process API tier (the app over ASGI, real SQLite, the real engine in threads),
# no process started, under a minute on two cores.
FAST_TESTS := -m "not slow" -n 2 tests/unit tests/api

.PHONY: lock upgrade

$(LOCK_TOOLS)/bin/pip-compile: $(LOCK)
	test -x $(LOCK_TOOLS)/bin/python || $(PYTHON) -m venv $(LOCK_TOOLS)
	$(LOCK_TOOLS)/bin/pip install --quiet "$$(grep -Eo '^pip-tools==[^ ]+' $(LOCK))"
	touch $@

# After a pyproject.toml change: re-resolve, keeping the lock's pins where they still fit.
lock: $(LOCK_TOOLS)/bin/pip-compile
	$(PIP_COMPILE) --output-file $(LOCK) pyproject.toml
	$(FINISH_LOCK) finish $(LOCK)

# Everything to its newest release (within pyproject's bounds) in a scratch lock and venv; the
# version diff is printed, the reference pages are regenerated with the scratch venv (a newer
# FastAPI or pydantic may change the OpenAPI schema; `git diff --stat` shows what moved, to commit
# with the lock), the fast suite runs against it, and only if it passes does the new lock replace
# the old one.
upgrade: $(LOCK_TOOLS)/bin/pip-compile
	rm -rf $(UPGRADE_DIR) && mkdir -p $(UPGRADE_DIR)
	$(PIP_COMPILE) --upgrade --upgrade-package '$(TORCH)' --output-file $(UPGRADE_DIR)/lock.txt \
		pyproject.toml
	$(FINISH_LOCK) finish $(UPGRADE_DIR)/lock.txt
	$(FINISH_LOCK) diff $(LOCK) $(UPGRADE_DIR)/lock.txt
	$(PYTHON) -m venv $(UPGRADE_DIR)/venv
	$(UPGRADE_DIR)/venv/bin/pip install --quiet --no-deps -r $(UPGRADE_DIR)/lock.txt
	$(UPGRADE_DIR)/venv/bin/pip install --quiet --no-deps -e .
	$(UPGRADE_DIR)/venv/bin/pip check
	$(UPGRADE_DIR)/venv/bin/python -m tools.docs_reference
	git diff --stat docs/reference
	PROXRL_LOCK=$(UPGRADE_DIR)/lock.txt $(UPGRADE_DIR)/venv/bin/python -m pytest -q $(FAST_TESTS)
	cp $(UPGRADE_DIR)/lock.txt $(LOCK)
	rm -rf $(UPGRADE_DIR)

# PostgreSQL for the tests that run the store on Postgres, Chromium for the dashboard's browser
# tests, HAProxy for the replica drills (tests/reliability/multihost.py) (Debian's packages;
# needs root).
system-deps:
	@missing=""; \
	command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="postgresql"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v haproxy >/dev/null 2>&1 || missing="$$missing haproxy"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (apt-get) for the tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

# Everything but the tests marked slow (the end-to-end runs and the reliability drills), which
# `make test-slow` runs; CI runs both.
# The in-process tiers (tests/unit, tests/api) on 2 workers, as make test-fast runs them (they start
# no process); then the tiers that start servers, one test at a time.
test: venv system-deps
	$(PY) -m pytest -q -m "not slow" -n 2 --durations=15 tests/unit tests/api
	$(PY) -m pytest -q -m "not slow" --durations=15 --ignore=tests/unit --ignore=tests/api

# On 2 workers, a file's tests together and the training tests on one worker
# (tests/conftest.py: xdist_group).
test-slow: venv system-deps
	$(PY) -m pytest -q -m slow -n 2 --dist loadgroup --durations=15

test-fast: venv
	$(PY) -m pytest -q --durations=10 $(FAST_TESTS)

# ruff format --check, ruff check and mypy, as .pre-commit-config.yaml defines them: the git hook
# (`make hooks` installs it) runs the same before each commit.
lint: venv
	$(VENV)/bin/pre-commit run --all-files

hooks: venv
	$(VENV)/bin/pre-commit install

format: venv
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: venv
	$(PY) bench/engine.py
	$(PY) bench/proxy.py
	$(PY) bench/proxy_cost.py --requests 400 --rounds 2
	$(PY) bench/proxy_floor.py
	$(PY) bench/replicas.py --requests 360 --rounds 2
	$(PY) bench/store_writes.py --turns 512 --producers 64
	$(PY) bench/trainer.py
	$(PY) bench/lora_swap.py --publishes 3
	$(PY) bench/dashboard.py
	$(PY) bench/export.py
	$(PY) bench/async_vs_sync.py
	$(PY) bench/staleness_ablation.py
	$(PY) bench/staleness_sim.py
	$(PY) bench/prefix_cache.py
	$(PY) bench/long_prompts.py --lengths 8192 32768

demo: venv
	$(VENV)/bin/proxrl demo

# Two LoRA runs learning two tasks on one engine, one rolled back mid-way (about 6 minutes).
demo-lora: venv
	$(VENV)/bin/proxrl demo --lora

# The documentation site: the reference pages (docs/reference/) regenerated from the code first
# (tests/unit/test_docs_reference.py fails while a committed one is stale), then built strictly
# into site/.
.PHONY: docs
docs: venv
	$(PY) -m tools.docs_reference
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
