"""``CpuEngineOptions`` as the CPU engine's view of the resolved configuration: one mapping
(``from_resolved``), the configuration's batching defaults, and LMI's ``n_positions`` default
taken from the checkpoint whatever its source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_lmi.backends.cpu.engine import CpuEngineOptions, load_cpu_model, resolve_cpu_dtype
from neuron_lmi.config import BatchingOptions, load_config
from neuron_lmi.config.options import DEFAULT_MAX_PREFILL_TOKENS


def test_from_resolved_maps_the_configuration(tiny_llama_dir: Path) -> None:
    cli = {
        "model_id": str(tiny_llama_dir),
        "max_rolling_batch_size": 4,
        "n_positions": 256,
        "max_queue_size": 7,
        "quantize": "int8",
        "enforce_eager": "true",
        "dtype": "bf16",
        "group_query_attention": "replicated-heads",
    }
    options = CpuEngineOptions.from_resolved(load_config(cli, None, env={}), "/fetched/model", tp_degree=2)
    assert options.model == "/fetched/model"
    assert (options.max_rolling_batch_size, options.n_positions, options.max_queue_size) == (4, 256, 7)
    assert (options.tensor_parallel_degree, options.quantize, options.dtype) == (2, "int8", "bf16")
    assert options.max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS
    assert options.compile_graphs is False
    assert options.group_query_attention == "replicated-heads"  # the CPU engine's sharding plan too


def test_from_resolved_defaults_are_the_servers() -> None:
    options = CpuEngineOptions.from_resolved(load_config({"model_id": "smollm2"}, None, env={}), "x", 1)
    assert options.dtype == resolve_cpu_dtype(None)  # the host's, not the configuration's fp16
    assert options.n_positions is None  # a built-in model: known once loaded
    assert options.compile_graphs is True
    assert options.compiled_graph_path is None


def test_batching_defaults_are_the_configurations() -> None:
    library, served = CpuEngineOptions(), BatchingOptions()
    assert library.max_rolling_batch_size == served.max_rolling_batch_size
    assert library.max_queue_size == served.max_queue_size
    assert library.n_positions is served.n_positions is None


@pytest.mark.parametrize(("max_positions", "expected"), [(8192, 4096), (1024, 1024)])
def test_n_positions_defaults_to_lmis_rule(tiny_llama_dir: Path, copy_dir, max_positions, expected) -> None:
    model_dir = copy_dir(tiny_llama_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_positions}))
    _, _, n_positions = load_cpu_model(
        CpuEngineOptions(model=str(model_dir), max_rolling_batch_size=1), model_dir
    )
    assert n_positions == expected
