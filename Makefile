# One virtual environment at .venv for everything. The CPU build of torch is pinned
# for this install only (the package itself asks for torch>=2.6 so GPU users keep theirs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench lint format soak clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_PIN)"
	$(PIP) install --quiet -e ".[dev]" "$(TORCH_PIN)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pitstop demo

# The HTML report test renders in headless Chromium (Debian's package), installed here when
# we are root and it is missing; without it that one test skips and says why.
CHROMIUM_INSTALL = command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || true

test: $(STAMP)
	$(CHROMIUM_INSTALL)
	$(PY) -m pytest -n 2 --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -m "not slow"

bench: $(STAMP)
	$(PY) -m bench.run_all

# The long crash-and-resume loop: at least 20 SIGKILLs at random moments, then bit-identical resume.
soak: $(STAMP)
	$(PY) -m pytest tests/reliability -m soak -s

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
