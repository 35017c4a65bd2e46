# Two commands do everything on a fresh machine:
#   make demo   create .venv, install kvoffload, run the main job
#   make test   the same set-up, then every gate: ruff, mypy, tests, coverage, README doctests
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed-stamp
SOURCES = kvoffload tests benchmarks

.PHONY: setup demo plan test lint typecheck bench replay clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The pinned CPU build of torch first, so nothing pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

plan: setup
	$(VENV)/bin/kvoffload plan tiny_gemma4 --block-size 32 \
		--extra-config '{"blocks_per_chunk": 2, "cpu_bytes_to_use": "64MiB"}'

demo: plan
	$(VENV)/bin/kvoffload demo

lint: setup
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)

typecheck: setup
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest --cov=kvoffload --cov-report=term-missing:skip-covered

bench: setup
	$(VENV)/bin/kvoffload bench --tier all

replay: setup
	$(VENV)/bin/kvoffload replay ../shared/traces/mooncake_conversation_trace.jsonl \
		--capacities 4000,16000,64000 --policy all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .coverage
