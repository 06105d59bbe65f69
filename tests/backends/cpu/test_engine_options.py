"""``CpuEngineOptions`` as the CPU engine's view of the resolved configuration: one mapping
(``from_resolved``) with no defaults of its own, serve's choices where a key is unset, and LMI's
``n_positions`` default taken from the checkpoint whatever its source."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from neuron_lmi.backends.cpu.engine import CpuEngineOptions, load_cpu_model, resolve_cpu_dtype
from neuron_lmi.config import BatchingOptions, load_config
from neuron_lmi.config.options import DEFAULT_MAX_PREFILL_TOKENS
from neuron_lmi.config.speculative import SpeculativeConfig
from neuron_lmi.engine.process_front import DEFAULT_MAX_RESTARTS
from tests.conftest import cpu_options


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
        "fail_fast": "true",
        "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
    }
    options = CpuEngineOptions.from_resolved(load_config(cli, None, env={}), "/fetched/model", tp_degree=2)
    assert options.model == "/fetched/model"
    assert (options.max_rolling_batch_size, options.n_positions, options.max_queue_size) == (4, 256, 7)
    assert (options.tensor_parallel_degree, options.quantize, options.dtype) == (2, "int8", "bf16")
    assert options.max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS
    assert options.compile_graphs is False
    assert options.group_query_attention == "replicated-heads"  # the CPU engine's sharding plan too
    assert options.max_restarts == 0  # SERVING_FAIL_FAST: the server exits instead
    assert options.speculative_config == SpeculativeConfig("ngram", 3)


def test_options_have_no_defaults_of_their_own() -> None:
    defaulted = [
        f.name
        for f in dataclasses.fields(CpuEngineOptions)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    ]
    assert defaulted == []
    with pytest.raises(TypeError):
        CpuEngineOptions()  # type: ignore[call-arg]


def test_from_resolved_defaults_are_the_servers() -> None:
    options = CpuEngineOptions.from_resolved(load_config({"model_id": "smollm2"}, None, env={}), "x", 1)
    assert options.dtype == resolve_cpu_dtype(None)  # the host's, not the configuration's fp16
    assert options.n_positions is None  # a built-in model: known once loaded
    assert options.compile_graphs is True  # the compiled step and extend unless option.enforce_eager
    assert options.compiled_graph_path is None and options.compiled is False  # no bucket runner
    assert options.no_compile is False and options.pack_weights is True
    assert options.max_restarts == DEFAULT_MAX_RESTARTS
    assert options.speculative_config is None
    served = BatchingOptions()
    assert options.max_rolling_batch_size == served.max_rolling_batch_size
    assert options.max_queue_size == served.max_queue_size


@pytest.mark.parametrize(("max_positions", "expected"), [(8192, 4096), (1024, 1024)])
def test_n_positions_defaults_to_lmis_rule(tiny_llama_dir: Path, copy_dir, max_positions, expected) -> None:
    model_dir = copy_dir(tiny_llama_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_positions}))
    options = cpu_options(model_dir, max_rolling_batch_size=1)
    assert options.n_positions == expected  # a local folder: the configuration reads it
    # A model fetched after the configuration was resolved (built-in, s3://, Hub): the engine does.
    _, _, n_positions = load_cpu_model(dataclasses.replace(options, n_positions=None), model_dir)
    assert n_positions == expected
