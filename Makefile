# AscendStore developer workflow. `make demo` and `make test` are all a new user needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.setup-stamp
# Installable parts of the workspace (each its own distribution), installed editable.
WORKSPACE := . connectors backends/mooncake backends/memcache conformance docs/examples/dirstore
SETUP_INPUTS := $(wildcard requirements/*.txt) pyproject.toml setup.py ascendstore/local/_shmpool.c \
	$(wildcard connectors/pyproject.toml backends/*/pyproject.toml conformance/pyproject.toml docs/examples/*/pyproject.toml)
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: setup test test-core test-mooncake demo lint chaos bench clean

setup: $(STAMP)

$(STAMP): $(SETUP_INPUTS)
	@echo "== setting up $(VENV) (lean CPU vLLM 0.33.0, torch 2.13.0 CPU)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install --no-deps vllm==0.33.0
	$(PIP) install -c requirements/vllm-cpu-constraints.txt -r requirements/vllm-cpu.txt
	$(PIP) install --no-deps xgrammar==0.2.8
	$(PIP) install -c requirements/vllm-cpu-constraints.txt -r requirements/dev.txt
	$(PIP) install --no-deps --no-build-isolation $(foreach p,$(WORKSPACE),$(if $(wildcard $(p)/pyproject.toml),-e $(p)))
	$(PY) setup.py -q build_ext --inplace
	touch $(STAMP)

# The whole suite: core and connector tests, then the Mooncake tests inside a
# private network namespace (Mooncake clients listen on all interfaces).
test: setup
	$(PYTEST) tests --ignore=tests/mooncake
	$(MAKE) --no-print-directory test-mooncake

test-core: setup
	$(PYTEST) tests --ignore=tests/mooncake

test-mooncake: setup
	@if [ -d tests/mooncake ]; then \
	  unshare -n bash -c 'ip link set lo up && $(PYTEST) tests/mooncake'; \
	fi

demo: setup
	$(PY) -m ascendstore.demo

# Fault injection in full (docs/failure-semantics.md): longer fault mixes, 200
# randomized two-engine interleavings per transfer mode (tests/chaos/test_interleaving.py), the
# Mooncake master SIGKILL in a private network namespace, then a soak (default
# 10 minutes, CHAOS_SOAK_S) printing RSS/open-file figures. Every part runs; the
# target fails if any did. `make test` runs the bounded form (tests/chaos).
chaos: setup
	@rc=0; \
	ASCENDSTORE_CHAOS_SECONDS=60 ASCENDSTORE_INTERLEAVE_ROUNDS=200 $(PYTEST) -s -rA tests/chaos || rc=1; \
	unshare -n bash -c 'ip link set lo up && $(PYTEST) -s tests/mooncake/test_chaos_mooncake.py' || rc=1; \
	$(PY) bench/chaos_soak.py --seconds $${CHAOS_SOAK_S:-600} || rc=1; \
	exit $$rc

lint: setup
	$(VENV)/bin/ruff check .

# Microbenchmarks: each prints ratios against a baseline measured in the same run.
bench: setup
	$(PY) bench/bench_local.py
	$(PY) bench/bench_connector.py
	$(PY) bench/bench_lookup.py
	$(PY) bench/bench_mooncake.py
	$(PY) bench/bench_release.py

clean:
	rm -rf $(VENV) build *.egg-info ascendstore/local/*.so
