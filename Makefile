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

# The real-model environment: vLLM built for CPU (real kernels) serving tiny models made
# here (docs/real-models.md). VLLM_CPU picks a pinned build: requirements/vllm-cpu-real-*.txt.
VLLM_CPU ?= 0.32.0
REAL_VENV ?= $(if $(filter 0.32.0,$(VLLM_CPU)),.venv-real,.venv-real-$(VLLM_CPU))
REAL_PY := $(REAL_VENV)/bin/python
REAL_PIP := $(REAL_PY) -m pip --disable-pip-version-check -q
REAL_LOCK := requirements/vllm-cpu-real-$(VLLM_CPU).txt
REAL_STAMP := $(REAL_VENV)/.setup-stamp
MODEL_CACHE ?= $(CURDIR)/.cache/models
REAL_PYTEST := ASCENDSTORE_MODEL_CACHE=$(MODEL_CACHE) $(REAL_PY) -m pytest -q -p no:cacheprovider

.PHONY: setup setup-real test test-core test-mooncake test-real demo lint chaos bench bench-agree bench-peers clean

setup: $(STAMP)

$(STAMP): $(SETUP_INPUTS)
	@echo "== setting up $(VENV) (lean CPU vLLM 0.33.0, torch 2.13.0 CPU)"
	bash scripts/system-deps.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install --no-deps vllm==0.33.0
	$(PIP) install -c requirements/vllm-cpu-constraints.txt -r requirements/vllm-cpu.txt
	$(PIP) install --no-deps xgrammar==0.2.8
	$(PIP) install -c requirements/vllm-cpu-constraints.txt -r requirements/dev.txt
	$(PIP) install --no-deps --no-build-isolation $(foreach p,$(WORKSPACE),$(if $(wildcard $(p)/pyproject.toml),-e $(p)))
	$(PY) setup.py -q build_ext --inplace
	touch $(STAMP)

setup-real: $(REAL_STAMP)

# Everything pinned in $(REAL_LOCK), installed with --no-deps (its torchvision/torchaudio/
# torchcodec would break `import transformers`); the workspace editable; the tiny models.
$(REAL_STAMP): $(REAL_LOCK) $(SETUP_INPUTS) connectors/ascendstore_vllm/testing/tiny_models.py
	@test -f $(REAL_LOCK) || { echo "no pinned list for vllm-cpu $(VLLM_CPU): $(REAL_LOCK)"; exit 2; }
	@echo "== setting up $(REAL_VENV) (vllm-cpu $(VLLM_CPU), torch 2.13.0 CPU)"
	test -x $(REAL_PY) || $(PYTHON) -m venv $(REAL_VENV)
	$(REAL_PIP) install --no-deps -r $(REAL_LOCK)
	$(REAL_PIP) install --no-deps --no-build-isolation $(foreach p,$(WORKSPACE),$(if $(wildcard $(p)/pyproject.toml),-e $(p)))
	$(REAL_PY) setup.py -q build_ext --inplace
	$(REAL_PY) -m ascendstore_vllm.testing.tiny_models --out $(MODEL_CACHE) llama
	touch $(REAL_STAMP)

# The whole suite: core and connector tests, then the Mooncake tests inside a
# private network namespace (Mooncake clients listen on all interfaces), then the
# real-model tests (vllm-cpu serving tiny models through its OpenAI server).
test: setup
	$(PYTEST) tests --ignore=tests/mooncake --ignore=tests/real
	$(MAKE) --no-print-directory test-mooncake
	$(MAKE) --no-print-directory test-real

# Real models on a real vLLM CPU build; `make test-real VLLM_CPU=0.30.0` for another build.
# Tests that start Mooncake (tests/real/mooncake) run in a private network namespace.
# REAL_SKIP: test files left out for a build (CI runs the hybrid/MLA ones on 0.32.0 only).
REAL_SKIP ?=
test-real: setup-real
	@bash scripts/system-deps.sh
	$(REAL_PYTEST) tests/real --ignore=tests/real/mooncake $(foreach f,$(REAL_SKIP),--ignore=$(f))
	unshare -n bash -c 'ip link set lo up && $(REAL_PYTEST) tests/real/mooncake'

test-core: setup
	$(PYTEST) tests --ignore=tests/mooncake --ignore=tests/real

test-mooncake: setup
	@bash scripts/system-deps.sh
	@if [ -d tests/mooncake ]; then \
	  unshare -n bash -c 'ip link set lo up && $(PYTEST) tests/mooncake'; \
	fi

# The modeled GR run (fast: fake model, modeled prefill time), then the measured one: real
# vLLM OpenAI servers (vllm-cpu) on a tiny model with and without the pool, timed by our client
# and by vLLM's own (vllm bench serve).
demo: setup setup-real
	$(PY) -m ascendstore.demo
	ASCENDSTORE_MODEL_CACHE=$(MODEL_CACHE) $(REAL_VENV)/bin/ascendstore bench --real --vllm-bench

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

# Microbenchmarks: each prints ratios against a baseline measured in the same run
# (configurations interleaved round by round; see bench/harness.py).
# BENCH_COMPACT: bench_local has the kernel compact free memory before each of its
# processes (where /proc/sys/vm/compact_memory is writable, i.e. as root): on 4 KiB
# pages a copy's speed follows how scattered a fresh mapping's pages are, which
# otherwise depends on how fragmented the host's free memory happens to be
# (docs/benchmarking.md). BENCH_COMPACT= (empty) measures without it.
BENCH_COMPACT ?= $(shell test -w /proc/sys/vm/compact_memory && echo 1)
bench: setup
	$(PY) bench/bench_local.py $(if $(BENCH_COMPACT),--compact-memory)
	$(PY) bench/bench_hugefill.py $(if $(BENCH_COMPACT),--compact-memory)
	$(PY) bench/bench_connector.py
	$(PY) bench/bench_lookup.py
	$(PY) bench/bench_mooncake.py
	$(PY) bench/bench_memcache.py
	$(PY) bench/bench_pins.py
	$(PY) bench/bench_release.py
	$(PY) bench/bench_staging.py

# Each microbenchmark twice; fails when a ratio's medians differ by more than 10%.
# BENCH_HUGETLBFS=DIR (a hugetlbfs mount with pages reserved) adds the local pool
# on huge pages to bench_local's configurations; BENCH_SHM_HUGE=advise (root) runs
# bench_local's pools over a private /dev/shm that grants transparent huge pages
# (docs/benchmarking.md).
BENCH_OUT ?= out/bench
BENCH_HUGETLBFS ?=
BENCH_SHM_HUGE ?=
bench-agree: setup
	mkdir -p $(BENCH_OUT); rc=0; \
	for i in 1 2; do \
	  $(PY) bench/bench_local.py --json $(if $(BENCH_COMPACT),--compact-memory) $(if $(BENCH_HUGETLBFS),--hugetlbfs $(BENCH_HUGETLBFS)) $(if $(BENCH_SHM_HUGE),--shm-huge $(BENCH_SHM_HUGE)) > $(BENCH_OUT)/local$$i.json || rc=1; \
	  $(PY) bench/bench_lookup.py --json $(BENCH_OUT)/lookup$$i.json > /dev/null || rc=1; \
	  $(PY) bench/bench_connector.py --json > $(BENCH_OUT)/connector$$i.json || rc=1; \
	done; \
	for b in local lookup connector; do \
	  echo "== $$b"; $(PY) bench/harness.py agree $(BENCH_OUT)/$${b}1.json $(BENCH_OUT)/$${b}2.json || rc=1; \
	done; exit $$rc

# The local pool side by side with LMCache 0.5.6 in one process, in a separate
# environment (LMCache pins its own dependencies; the project's core needs few).
PEERS_VENV ?= .venv-peers
PEERS_PY := $(PEERS_VENV)/bin/python
$(PEERS_VENV)/.stamp: bench/peers-requirements.txt
	test -x $(PEERS_PY) || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip --disable-pip-version-check -q install torch==2.13.0
	$(PEERS_PY) -m pip --disable-pip-version-check -q install --no-deps lmcache==0.5.6
	$(PEERS_PY) -m pip --disable-pip-version-check -q install -r bench/peers-requirements.txt
	@# the project's core from this tree (a .pth, no install: the C core built by `make setup`
	@# or here if missing, never rebuilt under a running benchmark)
	$(PEERS_PY) -c "import os, site; open(os.path.join(site.getsitepackages()[0], 'ascendstore-tree.pth'), 'w').write(os.getcwd() + '\n')"
	ls ascendstore/local/_shmpool*.so > /dev/null 2>&1 || $(PEERS_PY) setup.py -q build_ext --inplace
	touch $@

bench-peers: $(PEERS_VENV)/.stamp
	LMCACHE_DISABLE_BANNER=1 LMCACHE_TRACK_USAGE=false PYTHONHASHSEED=0 $(PEERS_PY) bench/bench_peers.py

clean:
	rm -rf $(VENV) $(PEERS_VENV) .venv-real* .cache/models build *.egg-info ascendstore/local/*.so
