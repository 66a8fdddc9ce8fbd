# The two commands of the contract: `make demo` and `make test`. Each one sets up
# everything on a fresh machine first (virtualenv, the package with its extras, Debian
# libraries the Mooncake wheel needs), then runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The scheduling hot path compiled in place by mypyc (setup.py; pure Python where that
# cannot be done). Rebuilt after any change to the router's sources, so a compiled module
# never runs older code than its source says (tests/conftest.py refuses a stale build).
COMPILED_STAMP := $(VENV)/.compiled-stamp
ROUTER_SOURCES := $(shell find router -name '*.py')
# NVIDIA's aiperf (a third-party benchmark client whose TTFT the tests compare with the
# router's) lives in a virtualenv of its own: its pins clash with ours.
AIPERF_VENV  := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed-stamp

.PHONY: demo test lint typecheck unit setup sysdeps up bench bench-quick clean

demo: setup
	$(BIN)/pdgate demo --config config

test: setup $(AIPERF_STAMP) lint typecheck
	$(BIN)/pytest

up: setup
	$(BIN)/pdgate up --config config

bench: setup
	$(BIN)/python -m benchmarks

bench-quick: setup
	$(BIN)/python -m benchmarks --quick

lint: setup
	$(BIN)/ruff check .

typecheck: setup
	$(BIN)/mypy

setup: $(STAMP) $(COMPILED_STAMP) sysdeps

# setup.py's build_ext runs on the virtualenv's own setuptools, which must read the SPDX
# `license` string of pyproject.toml: 77 on (the one a new virtualenv brings is older).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip 'setuptools>=77'
	PDGATE_COMPILE=0 $(BIN)/python -m pip install -q -e '.[test,sim,bench,tracing]'
	touch $(STAMP)

$(COMPILED_STAMP): $(STAMP) setup.py $(ROUTER_SOURCES)
	$(BIN)/python setup.py -q build_ext --inplace
	touch $(COMPILED_STAMP)

$(AIPERF_STAMP):
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q 'aiperf==0.13.0'
	touch $(AIPERF_STAMP)

# Debian packages: libibverbs1 (the Mooncake wheel links it even for TCP),
# redis-server (the global rate-limit tests start a real one) and prometheus (the
# dashboard test evaluates every panel's query on a real one scraping a live router).
sysdeps: $(STAMP)
	@$(BIN)/python -c "import mooncake.store" 2>/dev/null && command -v redis-server >/dev/null \
		&& command -v prometheus >/dev/null || sh scripts/install-sysdeps.sh

clean:
	rm -rf $(VENV) $(AIPERF_VENV) .mypy_cache .ruff_cache .pytest_cache build
	find . -path ./.venv -prune -o -name '*.so' -print -exec rm -f {} +
