# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup bench clean

setup: $(STAMP)

# setup.py builds the compiled parts (ms_memopt/native, the planner's search, ms_memopt/allocators/fast/: one C file
# per allocator model, the shared code and header, the run loop) with gcc; every C source and header they are built
# from is a prerequisite (the lists are ms_memopt/core/_build_hash.py's EXTENSIONS), so `make test` rebuilds after an edit. A library built from other sources than the tree's is refused at import anyway
# (a StaleBuildWarning, and the pure-Python references run): tests/test_build_hash.py fails on it.
$(STAMP): pyproject.toml setup.py ms_memopt/core/_build_hash.py $(wildcard ms_memopt/native/*.c) ms_memopt/analysis/planner/_search.c $(wildcard ms_memopt/allocators/fast/*.c ms_memopt/allocators/fast/*.h) ms_memopt/io/traces/_pickle_scan.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,mindformers]'
	# mindformers 2.0.0 (the release for MindSpore 2.10) alone, without its requirements: one of
	# them, hyper-parallel, is not on PyPI; the others come with the [mindformers] extra above, and
	# the tests put an import-only hyper_parallel stand-in on the path (tests/mindformers_support)
	$(BIN)/python -m pip install -q --no-deps 'mindformers==2.0.0'
	touch $(STAMP)

demo: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m ms_memopt.demo --out out/demo

test: $(STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pytest -q

bench: $(STAMP)
	for b in bench/*.py; do PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
