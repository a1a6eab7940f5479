# The two set-up commands of the README. Each creates .venv and installs what is missing.
# `make docs` serves the documentation; `make test` builds it strictly first (docs-check).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.plait-installed

.PHONY: demo test test-slow docs docs-check bench lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,demo,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/plait demo --tour

test: docs-check
	$(BIN)/python -m pytest -q

# The end-to-end set `make test` leaves out (tests/conftest.py's SLOW): whole demos and jobs
# through faults and launchers. CI runs it after `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# The docs (docs/, mkdocs.yml): a broken link, a missing page or a renamed symbol in the
# API reference fails the strict build, and with it `make test` (CI runs `make test`).
docs-check: $(STAMP)
	d=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d $$d; \
		rc=$$?; rm -rf $$d; exit $$rc

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

bench: $(STAMP)
	$(BIN)/python benchmarks/comm.py

lint: $(STAMP)
	$(BIN)/ruff check plait tests benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis site
