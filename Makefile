# The README's two commands. Both make their own virtualenv in .venv, so a fresh machine needs only
# python3 (>= 3.11) and a package index.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXAMPLE_CACHE ?= .cache/example
# setuptools ends every editable install with a notice that a folder named like the package in the working directory
# would shadow it. Here that folder is the package itself (the top flows/ and tasks/ hold only entrypoints), so the
# notice is silenced, for pip's build backend only and by its message.
EDITABLE := PYTHONWARNINGS='ignore:Editable installation' $(BIN)/pip install -q -e

.PHONY: example test test-fast lint docs cli-docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Install, then tokenize the bundled example on Prefect's embedded server; prints the cache path last.
example: $(BIN)/python
	$(EDITABLE) .
	$(BIN)/sft-tokenize run examples/data --tokenizer examples/tokenizer --cache-dir $(EXAMPLE_CACHE)

# Install with the dev, trainers and fast extras, then run the whole suite on three workers (docs/architecture.md,
# "The tests' lanes"); tests start and stop the services they need.
# pytest's exit code 5 (no test collected) fails like any other non-zero code.
# torch is pinned, which picks the CPU build where the find-links (pip's PIP_FIND_LINKS, read by uv too) or the index
# offer it (TORCH_INDEX=https://download.pytorch.org/whl/cpu elsewhere, installed first); the trainers extra's range
# admits it.
# axolotl goes in without its dependencies, which would replace torch, transformers and datasets: the tests use
# only its collators, which need numpy, torch, transformers and trl.
# The Prefect server tests run on SQLite and on PostgreSQL: Debian's `postgresql` package (apt-get install
# postgresql; .ci/run installs it), whose binaries tests/support/postgres.py starts on a throwaway cluster and
# stops. Without it those tests are skipped, unless SFT_TOKENIZE_TEST_POSTGRES=required (.ci/run sets it).
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
AXOLOTL ?= axolotl==0.19.0
LITDATA ?= litdata==0.2.76
# mosaicml-streaming pins an older transformers and huggingface-hub than datasets needs: it goes, without its
# dependencies, into a directory of its own, which tests/export/test_streams.py puts on a subprocess's path.
STREAMING ?= mosaicml-streaming==0.13.0
# Megatron-Bridge needs transformer-engine and CUDA to import: only its files are installed, from which
# tests/export/test_megatron.py loads its packer (packing_utils.py) and its SFT dataset module (sft.py, which needs
# only megatron-core, torch and datasets) to read the packed export with its own dataset and collator.
MEGATRON_BRIDGE ?= megatron-bridge==0.3.1
# The test install goes through uv, installed into the virtualenv by pip: it downloads and installs in parallel
# (pip took 68 s on a clean clone here). It compiles no bytecode (uv's default, not pip's): compiling all of
# site-packages, torch's thousands of files included, took 27 of the install's 30 s on a clean clone here, while the
# suite's processes write the bytecode of what they import as they first import it (about 7 s of CPU in one process
# for Prefect's server, transformers, datasets, torch, Ray and trl; the three workers, collecting at once, each
# compile part of what collection imports; pytest runs with PYTHONDONTWRITEBYTECODE cleared, below).
UV := $(BIN)/uv pip install -q --python $(BIN)/python \
	$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
# The tests, benchmarks and their helpers are imported by every worker and by the scripts the tests start: pytest
# runs (here and in test-fast) with their bytecode kept, its rewritten modules included, even where the environment
# says not to (PYTHONDONTWRITEBYTECODE): a second collection of the suite then takes 4.2 s of CPU, not 6-8 s.
test: $(BIN)/python
	$(BIN)/pip install -q uv
	$(if $(TORCH_INDEX),$(UV) --index-url $(TORCH_INDEX) '$(TORCH)')
	$(UV) '$(TORCH)' -e '.[dev,trainers,fast,export]'
	$(UV) --no-deps '$(AXOLOTL)' '$(LITDATA)'
	$(UV) --no-deps --upgrade --target .cache/consumers/streaming '$(STREAMING)' Brotli python-snappy cramjam zstd \
		catalogue
	$(UV) --no-deps --upgrade --target .cache/consumers/megatron-bridge '$(MEGATRON_BRIDGE)'
	$(BIN)/ruff check .
	$(MAKE) docs
	$(BIN)/python -m compileall -q sft_tokenize  # hundreds of test subprocesses import it, PYTHONDONTWRITEBYTECODE or not
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n 3 --dist loadgroup --no-loadscope-reorder \
		--junitxml=.cache/pytest-junit.xml

# The data plane's lane, for a change in progress: no Prefect server or harness, no cluster, no CLI subprocess, no
# trainers, nothing slow (about 90 s on 2 cores; three pytest workers, as some of its tests wait on timeouts). A
# test's lane comes from the fixtures it uses (tests/support/lanes.py). `make test` still runs everything.
# It installs again only when pyproject.toml changed since it last did (the install is editable: the code is read
# where it is).
test-fast: $(VENV)/installed-fast
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest --fast -n 3 --dist loadgroup

$(VENV)/installed-fast: pyproject.toml | $(BIN)/python
	$(EDITABLE) '.[dev,fast]'
	touch $@

lint: $(BIN)/python
	$(BIN)/ruff check .

# The documentation site (mkdocs.yml, docs/): strict, so a broken link, a missing anchor, a page left out of the nav
# or a missing included file fails the build. NO_MKDOCS_2_WARNING silences Material's banner about its end of life.
docs: $(BIN)/python
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir .cache/site

# docs/cli.md's flag tables, made again from the options' declarations (tests/unit/test_options.py checks them).
cli-docs:
	$(BIN)/python -c "import pathlib; from sft_tokenize.cli.arguments import with_flag_tables as made; \
	page = pathlib.Path('docs/cli.md'); page.write_text(made(page.read_text()))"
