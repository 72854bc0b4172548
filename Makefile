# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: run test lint install install-mpi clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The optional MPI backend (needs Debian's openmpi-bin libopenmpi-dev). nvcc without CUDA
# headers makes mpi4jax try its CUDA bridge and fail; empty CUDA_ROOT/CUDA_PATH builds the
# CPU bridge only (../shared/REFERENCE.md).
install-mpi: $(STAMP)
	d=$$(mktemp -d) && CUDA_ROOT=$$d CUDA_PATH=$$d $(PY) -m pip install --quiet -e '.[dev,mpi]'

run: $(STAMP)
	$(PY) -m experiments.resnet152 $(ARGS)

# Two pytest workers (pytest-xdist), a test file per worker at a time: most tests are bound by
# XLA's single-threaded compiler, so 2 workers on 2 cores take ~0.6 of one worker's time.
# Module fixtures (the smoke ablation) stay on one worker with --dist loadfile; the files
# go out in tests/conftest.py's order, longest first (--no-loadscope-reorder).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check jaxcomm experiments tests
	$(PY) -m ruff format --check jaxcomm experiments tests

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
