# The README's two commands. Both make their own virtualenv in .venv, so a fresh machine needs only
# python3 (>= 3.11) and a package index.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXAMPLE_CACHE ?= .cache/example

.PHONY: example test lint

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Install, then tokenize the bundled example on Prefect's embedded server; prints the cache path last.
example: $(BIN)/python
	$(BIN)/pip install -q -e .
	$(BIN)/sft-tokenize run examples/data --tokenizer examples/tokenizer --cache-dir $(EXAMPLE_CACHE)

# Install with the dev extra, then run the whole suite (tests start and stop the services they need).
# pytest's exit code 5 (no test collected) fails like any other non-zero code.
test: $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(BIN)/python
	$(BIN)/ruff check .
