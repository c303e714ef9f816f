# llmq — the two commands of the README are `make up` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install lock up down test lint bench clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

install: $(STAMP)  ## create .venv and install llmq with its test tools

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "llmq needs Python 3.11+"'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	@touch $(STAMP)

lock:  ## re-resolve constraints.txt (the pinned versions) from pyproject.toml's ranges
	rm -rf /tmp/llmq-lock && $(PYTHON) -m venv /tmp/llmq-lock
	/tmp/llmq-lock/bin/pip install --quiet --upgrade pip
	/tmp/llmq-lock/bin/pip install --quiet -e '.[test]'
	{ sed -n '/^#/p' constraints.txt; /tmp/llmq-lock/bin/pip freeze --all --exclude-editable \
	  | grep -v '^setuptools=='; } > constraints.txt.new && mv constraints.txt.new constraints.txt
	rm -rf /tmp/llmq-lock

up: install  ## run Kafka, Jaeger (when Go can build it) and the local stack; Ctrl-C stops all
	@$(BIN)/llmq up --jaeger

# Not on `install`: stopping must not reinstall first (offline, or upgrading packages under
# a running stack) after a pull that touched pyproject.toml.
down:  ## stop what `make up` started in the background
	@if [ ! -x $(BIN)/llmq ]; then echo "make down: no $(BIN)/llmq, so nothing make up started runs"; exit 0; fi; \
	set -x; $(BIN)/llmq down && { $(BIN)/llmq dev jaeger down || true; }

test: install  ## start Kafka if needed, run the whole suite, stop what it started
	@bash scripts/test.sh

lint: install  ## ruff + mypy strict on schemas/, services/ and the llmq/ SDK
	$(BIN)/ruff check schemas services llmq tests scripts
	$(BIN)/mypy

bench: install  ## the policy matrix on the Azure traces, seed 1 (docs/benchmarks.md; ~20 s)
	$(BIN)/llmq bench policies --matrix

clean:  ## remove the venv and caches (keeps .llmq/, the broker cache and data)
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
