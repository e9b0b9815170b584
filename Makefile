# Two set-up commands for a fresh machine: `make demo` and `make test`.
# `make test` is the fast tier (under 2 minutes); `make test-all` adds the slow
# tier (end-to-end training, multi-process, soak) and is what CI runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all venv bench bench-peers clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,torch,ray]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m sluice.demo --out demo-out

# The fast tier on TEST_WORKERS pytest-xdist workers (CI has 2 cores). --dist loadfile
# keeps each test file on one worker, so a module's fixtures (a daemon, a corpus) are
# built once. TEST_WORKERS=0 runs it in this process, one test after the other.
TEST_WORKERS ?= 2
# The tests write bytecode caches (__pycache__/, ignored by git) even where the environment
# sets PYTHONDONTWRITEBYTECODE: without them every xdist worker rewrites the asserts of every
# test module again (~6 s of CPU a worker) and every daemon and CLI process the tests start
# compiles sluice again (~0.1 s each). PYTEST_ENV= keeps the environment's setting.
PYTEST_ENV ?= env -u PYTHONDONTWRITEBYTECODE
test: $(STAMP)
	$(PYTEST_ENV) $(BIN)/python -m pytest -q -m 'not slow' -n $(TEST_WORKERS) --dist loadfile

# The fast tier as `make test` runs it (on TEST_WORKERS workers) but with every Hypothesis example, then the slow
# tier serially: its multi-process and soak tests are timed against one machine's cores. Both parts run (a failure
# of the first does not hide the second's) and share one numba cache folder, made here and removed after, so the
# kernels are compiled once, not once a part. Exits non-zero if either part failed.
test-all: $(STAMP)
	@tmp=$$(mktemp -d "$${TMPDIR:-/tmp}/sluice-test-all.XXXXXX") || exit 1; \
	trap 'rm -rf "$$tmp"' EXIT; \
	export NUMBA_CACHE_DIR="$$tmp/numba-cache" SLUICE_TEST_EXAMPLES=full; \
	echo "fast tier ($(TEST_WORKERS) workers, every example):"; \
	$(PYTEST_ENV) $(BIN)/python -m pytest -q -m 'not slow' -n $(TEST_WORKERS) --dist loadfile; fast=$$?; \
	echo "slow tier (serial):"; \
	$(PYTEST_ENV) $(BIN)/python -m pytest -q -m slow; slow=$$?; \
	echo "test-all: fast tier exit $$fast, slow tier exit $$slow"; \
	[ $$fast -eq 0 ] && [ $$slow -eq 0 ]

bench: $(STAMP)
	$(BIN)/python bench/freeze.py

# Side by side with the peer loaders (installs each in bench/peers/.venvs/; never run by `make test`).
# ARGS=--quick: docs/performance.md's table 2 (from tokens, both workloads) in 2 rounds, about 3 minutes.
bench-peers: $(STAMP)
	$(BIN)/python bench/peers/run.py $(ARGS)

clean:
	rm -rf $(VENV) demo-out bench/out
