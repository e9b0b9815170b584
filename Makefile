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

test: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow'

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/freeze.py

# Side by side with the peer loaders (installs each in bench/peers/.venvs/; never run by `make test`).
# ARGS=--quick for a short run.
bench-peers: $(STAMP)
	$(BIN)/python bench/peers/run.py $(ARGS)

clean:
	rm -rf $(VENV) demo-out bench/out
