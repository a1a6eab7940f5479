# The two set-up commands of the README. Each creates .venv and installs what is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.plait-installed

.PHONY: demo test bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,demo]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/plait demo --tour

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/comm.py

lint: $(STAMP)
	$(BIN)/ruff check plait tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
