# Two-command quick start (see README.md):
#   make run    set up the virtual environment and run the main job
#   make test   set up the virtual environment and run the whole test suite (+ ruff, mypy)
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The main job. Until `prfaas serve` lands this is the planner on the paper's case study.
run: $(STAMP)
	$(BIN)/prfaas plan --config prfaas/examples/paper_case_study.toml

test: $(STAMP)
	$(BIN)/python -m pytest
	$(BIN)/ruff check prfaas tests benchmarks
	$(BIN)/ruff format --check prfaas tests benchmarks
	$(BIN)/mypy

lint: $(STAMP)
	$(BIN)/ruff check prfaas tests benchmarks
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/planner.py --json results/planner.json

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
