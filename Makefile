# The two commands of the README. Both set up .venv on a fresh machine first.
VENV   ?= .venv
PYTHON ?= python3
STAMP  := $(VENV)/.installed

.PHONY: run test clean

run: $(STAMP)
	$(VENV)/bin/kiln run

test: $(STAMP)
	$(VENV)/bin/pytest

# torch is pinned to the CPU build (requirements.txt); kiln itself installs without deps
# so pip cannot swap that pin for a CUDA build.
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet -r requirements.txt
	$(VENV)/bin/pip install --quiet --no-deps -e .
	touch $@

clean:
	rm -rf .kiln mlruns
