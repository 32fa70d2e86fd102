# One virtual environment at .venv for everything. The CPU build of torch is pinned
# for this install only (the package itself asks for torch>=2.6 so GPU users keep theirs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The versions `make test` and `make demo` install (docs/development.md#the-locked-test-environment):
# a fresh clone tests what the last green run tested, not whatever was released since.
CONSTRAINTS := constraints.txt

.PHONY: install demo test test-clients test-reliability test-long test-fast bench lint format soak soak-load clean test-oldest test-newest lock

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_PIN)"
	$(PIP) install --quiet -c $(CONSTRAINTS) -e ".[dev]" "$(TORCH_PIN)"
	touch $(STAMP)

# Refresh constraints.txt with the newest releases pip finds, then run `make test` on them.
lock:
	rm -rf .venv-lock
	$(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install --quiet --upgrade pip
	.venv-lock/bin/python -m pip install --quiet -e ".[dev]" "$(TORCH_PIN)"
	.venv-lock/bin/python scripts/write_constraints.py .venv-lock/bin/python $(CONSTRAINTS)
	rm -rf .venv-lock

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pitstop demo

# The HTML report test renders in headless Chromium (Debian's package), installed here when
# we are root and it is missing; without it that one test skips and says why.
CHROMIUM_INSTALL = command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || true

# `make test` leaves out the real-client, reliability and long suites (their own targets
# below; CI runs all four): on 2 cores it takes well under 10 minutes (issue 45).
test: $(STAMP)
	$(CHROMIUM_INSTALL)
	$(PY) -m pytest -n 2 --durations=25 -m "not clients and not reliability and not long"

# The longest multi-process and end-to-end runs (the `long` marker: torchrun DDP/FSDP2 runs
# against one process, the headline and compare smoke runs, two measured-memory cases); CI
# runs it after `make test`. Run it after a change to distributed training, checkpoints
# under FSDP2, the benchmarks or the memory estimate.
test-long: $(STAMP)
	$(PY) -m pytest -n 2 --durations=15 -m long

# The reliability suite (tests/reliability, docs/guarantees.md): each promise checked on real
# `python -m pitstop` processes that are killed, signalled, starved of disk; CI runs it after
# `make test`. Run it after a change to a fault point, a signal, the checkpoint writer, the
# run lock, the cache or the data readers (`make soak-load` repeats it under load).
test-reliability: $(STAMP)
	$(PY) -m pytest -n 2 --durations=15 -m reliability tests/reliability

# The real-client suite (tests/test_clients.py): pitstop on nanoGPT-style, accelerate,
# Lightning, Trainer and TRL programs, each a process of its own; CI runs it after `make test`.
# Each program's tests are one xdist group (a worker makes its runs once and shares them).
test-clients: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup --durations=10 -m clients

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -m "not slow"

bench: $(STAMP)
	$(PY) -m bench.run_all

# The long crash-and-resume loop: at least 20 SIGKILLs at random moments, then bit-identical resume.
soak: $(STAMP)
	$(PY) -m pytest tests/reliability -m soak -s

# The reliability suite RUNS times in a row while a busy loop per core keeps the machine
# busy (docs/fault-injection.md): the check that no test there depends on the machine's speed.
RUNS ?= 20
soak-load: $(STAMP)
	$(PY) scripts/under_load.py --runs $(RUNS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# The supported-versions matrix (docs/versions.md): the packed-attention tests, the version
# checks and a short training run against the oldest supported torch + transformers pair,
# and against the newest pip finds. Each builds its own venv once. Not part of `make test`:
# PyPI's torch 2.6 is the CUDA build (several GB). TORCH_OLDEST=torch==2.13.0 tests
# transformers 4.56 with another torch without that download.
TORCH_OLDEST ?= torch==2.6.0
TRANSFORMERS_OLDEST ?= transformers==4.56.*
MATRIX_DEPS = pytest pytest-timeout hypothesis
VERSION_MATRIX_TESTS = tests/test_versions.py tests/test_attention_packed.py tests/test_packcheck.py \
	tests/test_attention_families.py tests/test_attention_per_document.py \
	tests/test_positions.py

.venv-oldest/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv .venv-oldest
	.venv-oldest/bin/python -m pip install --quiet --upgrade pip
	.venv-oldest/bin/python -m pip install --quiet "$(TORCH_OLDEST)" "$(TRANSFORMERS_OLDEST)" -e . $(MATRIX_DEPS)
	touch $@

.venv-newest/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv .venv-newest
	.venv-newest/bin/python -m pip install --quiet --upgrade pip
	.venv-newest/bin/python -m pip install --quiet --upgrade torch transformers -e . $(MATRIX_DEPS)
	touch $@

test-oldest: .venv-oldest/.installed
	.venv-oldest/bin/python -c "import torch, transformers; print('oldest pair: torch', torch.__version__, 'transformers', transformers.__version__)"
	.venv-oldest/bin/python -m pytest -p no:cacheprovider $(VERSION_MATRIX_TESTS)

test-newest: .venv-newest/.installed
	.venv-newest/bin/python -c "import torch, transformers; print('newest pair: torch', torch.__version__, 'transformers', transformers.__version__)"
	.venv-newest/bin/python -m pytest -p no:cacheprovider $(VERSION_MATRIX_TESTS)

clean:
	rm -rf $(VENV) .venv-oldest .venv-newest .venv-lock .pytest_cache build *.egg-info
