# The two commands of the README. Both set up .venv on a fresh machine first.
VENV   ?= .venv
PYTHON ?= python3
STAMP  := $(VENV)/.installed

.PHONY: run test docs triton-env mutants clean

run: $(STAMP)
	$(VENV)/bin/kiln keys init --if-missing
	$(VENV)/bin/kiln run

# Two workers, a test file each at a time (module fixtures such as `kiln up` stay shared
# within a file); the suite keeps both cores of a 2-core machine busy, so what shortens it is
# less computing, not more workers. The longest files go first (tests/conftest.py), not the
# ones with the most tests.
# The suite starts some 150 Python processes (kiln verbs, servers, flow runs, engine
# processes), each importing kiln's own modules: compiled here once, not in every one of them
# (where PYTHONDONTWRITEBYTECODE is set, nothing else writes their bytecode; see $(UV) below).
test: $(STAMP)
	$(VENV)/bin/python -m compileall -q components flows registry serving benchmarks tests
	$(VENV)/bin/pytest -n 2 --dist loadfile --no-loadscope-reorder

# The documentation site on http://127.0.0.1:8001 (mkdocs.yml's dev_addr: kiln serve keeps 8000), rebuilt on every change; its reference
# pages are generated from the code (docs/hooks/reference.py).
docs: $(STAMP)
	$(VENV)/bin/python docs/hooks/reference.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# uv installs the pinned stack in well under a minute where pip takes over 3 (it downloads
# and unpacks in parallel). It compiles the bytecode at install, as pip does: where
# PYTHONDONTWRITEBYTECODE is set (CI images set it), nothing else would, and every process
# would compile torch, transformers and mlflow again (imports 2.5x slower). uv does not
# read pip's configuration: the find-links that hold the CPU torch wheel are passed on.
# kiln itself installs without deps so the installer cannot swap the torch it got for another.
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV := $(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(VENV)/bin/python $(addprefix --find-links ,$(FIND_LINKS))

# TORCH=cpu (the default): torch's CPU build (about 0.8 GB installed), from PyTorch's CPU
# index, or from a local wheel folder (pip's find-links) that holds one. TORCH=cuda: PyPI's
# torch, the CUDA build (several GB more), for the torch-cuda backend on an NVIDIA GPU.
TORCH ?= cpu
TORCH_PIN := $(shell grep -E '^torch==' requirements.txt | cut -d' ' -f1)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
LOCAL_CPU_TORCH := $(firstword $(wildcard $(addsuffix /torch-*+cpu-*.whl,$(FIND_LINKS))))
TORCH_SOURCE := $(if $(LOCAL_CPU_TORCH),,--index-url $(TORCH_CPU_INDEX))
ifeq ($(filter $(TORCH),cpu cuda),)
$(error TORCH must be cpu or cuda, not "$(TORCH)")
endif

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet uv==0.13.9
	$(if $(filter cpu,$(TORCH)),$(UV) $(TORCH_SOURCE) "$(TORCH_PIN)")
	$(UV) -r requirements.txt
	$(UV) --no-deps -e .
	touch $@

# The Triton environment: the real tritonserver that PyPI's nvidia-pytriton bundles, with
# kiln's runtime for its Python backend (`kiln export triton`, tests/test_triton.py).
TRITON_VENV ?= .triton-venv
triton-env: $(TRITON_VENV)/.installed

$(TRITON_VENV)/.installed: requirements-triton.txt pyproject.toml
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install --quiet uv==0.13.9
	$(TRITON_VENV)/bin/uv pip install --quiet --compile-bytecode --python $(TRITON_VENV)/bin/python $(addprefix --find-links ,$(FIND_LINKS)) -r requirements-triton.txt
	$(TRITON_VENV)/bin/uv pip install --quiet --compile-bytecode --python $(TRITON_VENV)/bin/python --no-deps -e .
	touch $@

# Mutation testing (not part of `make test`: it runs the fast tests once per mutant, which
# takes a long time); the stages' outputs are cached across those runs in .kiln/test-cache.
mutants: $(STAMP)
	$(UV) mutmut==3.8.1
	KILN_TEST_CACHE=$(CURDIR)/.kiln/test-cache $(VENV)/bin/mutmut run --max-children 2
	$(VENV)/bin/mutmut results

clean:
	rm -rf .kiln mlruns mutants $(TRITON_VENV)
