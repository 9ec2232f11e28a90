# The two commands of the README. Both set up .venv on a fresh machine first.
VENV   ?= .venv
PYTHON ?= python3
STAMP  := $(VENV)/.installed

.PHONY: run test mutants clean

run: $(STAMP)
	$(VENV)/bin/kiln run

# Two workers, a test file each at a time (module fixtures such as `kiln up` stay shared
# within a file): the suite waits on servers and subprocesses as much as it computes. The
# longest files go first (tests/conftest.py), not the ones with the most tests.
test: $(STAMP)
	$(VENV)/bin/pytest -n 2 --dist loadfile --no-loadscope-reorder

# torch is pinned to the CPU build (requirements.txt); kiln itself installs without deps
# so pip cannot swap that pin for a CUDA build.
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -r requirements.txt
	$(VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

# Mutation testing (not part of `make test`: it runs the fast tests once per mutant, which
# takes a long time); the stages' outputs are cached across those runs in .kiln/test-cache.
mutants: $(STAMP)
	$(VENV)/bin/pip install --quiet mutmut==3.8.1
	KILN_TEST_CACHE=$(CURDIR)/.kiln/test-cache $(VENV)/bin/mutmut run --max-children 2
	$(VENV)/bin/mutmut results

clean:
	rm -rf .kiln mlruns mutants
