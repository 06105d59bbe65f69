"""Bad values raise ConfigError naming the key as written, the value and where it came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_lmi.config import ConfigError, apply_model_defaults, default_n_positions


@pytest.mark.parametrize(
    ("var", "value", "reason"),
    [
        ("OPTION_TENSOR_PARALLEL_DEGREE", "0", "between 1 and 1024"),
        ("OPTION_TENSOR_PARALLEL_DEGREE", "two", "positive integer or 'max'"),
        ("TENSOR_PARALLEL_DEGREE", "-2", "between 1 and 1024"),
        ("OPTION_DTYPE", "int4", "'fp32', 'bf16' or 'fp16'"),
        ("OPTION_MAX_ROLLING_BATCH_SIZE", "0", "greater than or equal to 1"),
        ("MAX_BATCH_SIZE", "lots", "valid integer"),
        ("OPTION_N_POSITIONS", "4k", "valid integer"),
        ("OPTION_NEURON_OPTIMIZE_LEVEL", "4", "less than or equal to 3"),
        ("OPTION_ROLLING_BATCH", "fast", "'auto'"),
        ("OPTION_GROUP_QUERY_ATTENTION", "shard-over-tokens", "shard-over-heads"),
        ("OPTION_QUANTIZE", "int3", "static_int8"),
        ("OPTION_MODEL_LOADING_TIMEOUT", "-5", "greater than 0"),
        ("OPTION_CONTEXT_LENGTH_ESTIMATE", "256,128", "strictly increasing"),
        ("OPTION_CONTEXT_LENGTH_ESTIMATE", "128,abc", "valid integer"),
        ("OPTION_BACKEND", "tpu", "'auto', 'cpu', 'neuron' or 'vllm'"),
        ("SERVING_FAIL_FAST", "maybe", "valid boolean"),
        ("SERVING_PORT", "70000", "less than or equal to 65535"),
        ("SERVING_ENGINE", "Rust", "'Python' or 'MPI'"),
    ],
)
def test_bad_environment_value_names_key_value_and_source(load, var, value, reason):
    with pytest.raises(ConfigError) as info:
        load(env={var: value})
    error = info.value
    assert isinstance(error, ValueError)
    assert (error.key, error.value, error.source) == (var, value, f"env:{var}")
    assert var in str(error) and repr(value) in str(error) and f"env:{var}" in str(error)
    assert reason in str(error)


def test_bad_properties_value_names_the_file(load, write_props):
    props = write_props("engine=Python\noption.tensor_parallel_degree=zero\n")
    with pytest.raises(ConfigError) as info:
        load(properties=props)
    assert info.value.key == "option.tensor_parallel_degree"
    assert info.value.value == "zero"
    assert info.value.source == f"serving.properties:{props}"


def test_bad_cli_value_names_the_flag(load):
    with pytest.raises(ConfigError, match=r"--max-rolling-batch-size=-1 \(from cli\)"):
        load(cli={"max_rolling_batch_size": -1})


def test_a_shadowed_bad_value_is_not_an_error(load):
    resolved = load(cli={"dtype": "bf16"}, env={"OPTION_DTYPE": "int4"})
    assert resolved.config.model.dtype == "bf16"


def test_context_estimate_beyond_n_positions(load):
    with pytest.raises(ConfigError) as info:
        load(env={"OPTION_N_POSITIONS": "1024", "OPTION_CONTEXT_LENGTH_ESTIMATE": "512,2048"})
    assert info.value.key == "OPTION_CONTEXT_LENGTH_ESTIMATE"
    assert "exceeds n_positions=1024" in str(info.value)


def test_batch_size_must_match_rolling_batch_size(load):
    with pytest.raises(ConfigError, match=r"OPTION_BATCH_SIZE.*max_rolling_batch_size=32"):
        load(env={"OPTION_BATCH_SIZE": "4"})
    same = load(env={"OPTION_BATCH_SIZE": "8", "MAX_BATCH_SIZE": "8"}).config.batching
    assert same.effective_batch_size == 8
    static = load(env={"OPTION_BATCH_SIZE": "4", "OPTION_ROLLING_BATCH": "disable"}).config.batching
    assert (static.rolling, static.effective_batch_size) == (False, 4)
    assert load().config.batching.effective_batch_size == 32


def test_api_key_is_masked_even_in_errors(load):
    with pytest.raises(ConfigError) as info:
        load(env={"NEURON_LMI_API_KEY": "s3cr3t", "SERVING_PORT": "-1"})
    assert "s3cr3t" not in str(info.value)


@pytest.mark.parametrize(("max_pos", "expected"), [(None, 2048), (0, 2048), (512, 512), (131072, 4096)])
def test_default_n_positions(max_pos, expected):
    assert default_n_positions(max_pos) == expected


def test_apply_model_defaults_fills_n_positions_only_when_unset(load):
    filled = apply_model_defaults(load(), 32768)
    assert filled.config.batching.n_positions == 4096
    assert filled.sources["n_positions"] == "default:min(max_position_embeddings=32768, 4096)"
    assert apply_model_defaults(load(), None).config.batching.n_positions == 2048
    explicit = load(env={"OPTION_N_POSITIONS": "8192"})
    assert apply_model_defaults(explicit, 32768) is explicit


def test_apply_model_defaults_checks_the_estimate(load):
    resolved = load(env={"OPTION_CONTEXT_LENGTH_ESTIMATE": "8192"})
    with pytest.raises(ConfigError, match=r"n_positions=4096") as info:
        apply_model_defaults(resolved, 32768)
    assert (info.value.key, info.value.value) == ("OPTION_CONTEXT_LENGTH_ESTIMATE", "8192")


def test_local_model_config_sets_n_positions(load, tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    resolved = load(env={"HF_MODEL_ID": str(model)})
    assert resolved.config.batching.n_positions == 1024
    assert resolved.sources["n_positions"].startswith("default:min(max_position_embeddings=1024")
