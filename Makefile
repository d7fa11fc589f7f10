# Two-command quick start (see README.md):
#   make run    set up the virtual environment and run the main job
#   make test   set up the virtual environment and run the whole test suite (+ ruff, mypy)
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CHROMIUM ?= /usr/bin/chromium

.PHONY: run plan test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[engine,plots,test]'
	touch $(STAMP)

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
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
	@test -x $(CHROMIUM) || { echo "make: apt installed chromium but $(CHROMIUM) is missing" >&2; exit 1; }

test: $(STAMP) $(CHROMIUM)
	PRFAAS_CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest
	$(BIN)/ruff check prfaas tests benchmarks
	$(BIN)/ruff format --check prfaas tests benchmarks
	$(BIN)/mypy

lint: $(STAMP)
	$(BIN)/ruff check prfaas tests benchmarks
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
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
