# capsnet: every target sets up what it needs on a fresh Debian/Ubuntu machine.
#   make install   .venv with capsnet and its dependencies, then the op library (`make ops`)
#   make ops       build the compiled op: CPU kernels, plus the CUDA ones where nvcc and a GPU
#                  driver are found (minutes of nvcc for nothing on a machine without a GPU)
#   make ops-cuda  build it with the CUDA kernels, GPU driver or not (needs nvcc; `docker build`)
#   make ops-cpu   build it without them
#   make test      install, then the fast tier of the tests (in parallel, one worker per core; minutes)
#   make test-full install, then every test, the slow tier too (what CI runs)
#   make train     install, then a first training of about a minute on a CPU (experiment=quickstart, offline
#                  on the MNIST sample in the package); ARGS="..." trains with those Hydra overrides
#                  instead, e.g. ARGS="experiment=paper_mnist data.dir=/data/mnist" for the paper's 100-epoch recipe
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# pyproject extras installed into .venv (the Dockerfile adds `cuda`)
EXTRAS ?= test,plots

# First interpreter in 3.10-3.12 (TensorFlow 2.21 wheels); override with PYTHON=...
PYTHON ?= $(shell for p in python3.12 python3.11 python3.10 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(not (3,10) <= sys.version_info[:2] <= (3,12))' 2>/dev/null \
	&& { echo $$p; break; }; done)

.PHONY: install ops ops-cpu ops-cuda test test-full train clean

install: $(VENV)/.installed ops

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "make: need Python 3.10-3.12 (python3.12/3.11/3.10 on PATH, or PYTHON=...)"; exit 1; }
	@$(PYTHON) -c 'import venv, ensurepip' 2>/dev/null || { echo "make: $(PYTHON) lacks venv/ensurepip: apt-get install python3-venv"; exit 1; }
	@echo "make: installing capsnet, TensorFlow and the other dependencies into $(VENV): 4-5 minutes, pip's lines below"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install --progress-bar off -e '.[$(EXTRAS)]'
	@touch $@

# The op library goes into the package (capsnet/lib) so the wrapper, SavedModels
# and installed copies find it without paths. Which kernels: scripts/build_ops.py's docstring
# (a GPU driver is what `ops` looks for: build_ops.gpu_driver).
ops: $(VENV)/.installed
	$(PY) scripts/build_ops.py

ops-cpu: $(VENV)/.installed
	$(PY) scripts/build_ops.py --cpu-only

ops-cuda: $(VENV)/.installed
	$(PY) scripts/build_ops.py --require-cuda

# The suite in parallel (pytest-xdist, one worker per core: TEST_WORKERS=1 for one process).
# Tiers (tests/README.md): `make test` leaves out tests marked `slow` (entry points run as
# processes, signals and kills, multi-worker, allocator limits, longer trainings); a -m in
# PYTEST_ARGS comes later on the line and replaces the tier's.
TEST_WORKERS ?= auto
test: install
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

test-full: install
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

train: install
	$(PY) train.py $(if $(strip $(ARGS)),$(ARGS),experiment=quickstart)

clean:
	rm -rf build capsnet/lib/*.so
