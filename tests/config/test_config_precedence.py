"""Precedence CLI > serving.properties > environment > default, and where each value came from."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from neuron_lmi.config import KEYS, ConfigError, cli_overrides, parse_properties

ALL_FOUR = {
    "cli": {"tensor_parallel_degree": 8},
    "properties": "option.tensor_parallel_degree=4\n",
    "env": {"OPTION_TENSOR_PARALLEL_DEGREE": "2"},
}


@pytest.mark.parametrize(
    ("present", "value", "source"),
    [
        (("cli", "properties", "env"), 8, "cli"),
        (("properties", "env"), 4, "serving.properties:"),
        (("env",), 2, "env:OPTION_TENSOR_PARALLEL_DEGREE"),
        ((), 1, "default"),
        (("cli", "env"), 8, "cli"),
        (("cli", "properties"), 8, "cli"),
    ],
)
def test_same_key_from_every_place(load, write_props, present, value, source):
    props = write_props(ALL_FOUR["properties"]) if "properties" in present else None
    resolved = load(
        cli=ALL_FOUR["cli"] if "cli" in present else None,
        properties=props,
        env=ALL_FOUR["env"] if "env" in present else None,
    )
    assert resolved.config.parallel.tensor_parallel_degree == value
    assert resolved.sources["tensor_parallel_degree"].startswith(source)
    if source == "serving.properties:":
        assert resolved.sources["tensor_parallel_degree"] == f"serving.properties:{props}"


def test_every_field_has_a_source(load, write_props):
    props = write_props("engine=Python\noption.model_id=/models/llama\noption.dtype=bf16\n")
    resolved = load(cli={"port": 9000}, properties=props, env={"SERVING_FAIL_FAST": "true"})
    assert set(resolved.sources) == {spec.field for spec in KEYS}
    assert resolved.sources["port"] == "cli"
    assert resolved.sources["model_id"] == f"serving.properties:{props}"
    assert resolved.sources["engine"] == f"serving.properties:{props}"
    assert resolved.sources["fail_fast"] == "env:SERVING_FAIL_FAST"
    assert resolved.sources["max_rolling_batch_size"] == "default"
    assert resolved.config.server.fail_fast is True
    assert resolved.config.model.dtype == "bf16"


@pytest.mark.parametrize(
    ("env", "field", "value"),
    [
        ({"HF_MODEL_ID": "org/model"}, "model_id", "org/model"),
        ({"TENSOR_PARALLEL_DEGREE": "max"}, "tensor_parallel_degree", "max"),
        ({"SM_NUM_GPUS": "4"}, "tensor_parallel_degree", 4),
        ({"MAX_BATCH_SIZE": "16"}, "max_rolling_batch_size", 16),
        ({"OPTION_ROLLING_BATCH": "TNX"}, "rolling_batch", "tnx"),
        ({"OPTION_CONTEXT_LENGTH_ESTIMATE": "128, 512"}, "context_length_estimate", (128, 512)),
        ({"OPTION_GROUP_QUERY_ATTENTION": "shard-over-heads"}, "group_query_attention", "shard-over-heads"),
        ({"OPTION_ENABLE_SATURATE_INFINITY": "TRUE"}, "enable_saturate_infinity", True),
        ({"SERVING_JOB_QUEUE_SIZE": "50"}, "max_queue_size", 50),
        ({"SERVING_ENGINE": "mpi"}, "engine", "MPI"),
        ({"OPTION_DTYPE": "float16"}, "dtype", "fp16"),
    ],
)
def test_environment_names(load, env, field, value):
    resolved = load(env=env)
    spec = next(s for s in KEYS if s.field == field)
    assert getattr(getattr(resolved.config, spec.section), field) == value
    assert resolved.sources[field] == f"env:{next(iter(env))}"


def test_environment_aliases_in_priority_order(load):
    env = {"OPTION_TENSOR_PARALLEL_DEGREE": "8", "TENSOR_PARALLEL_DEGREE": "4", "SM_NUM_GPUS": "2"}
    assert load(env=env).sources["tensor_parallel_degree"] == "env:OPTION_TENSOR_PARALLEL_DEGREE"
    del env["OPTION_TENSOR_PARALLEL_DEGREE"]
    assert load(env=env).config.parallel.tensor_parallel_degree == 4
    del env["TENSOR_PARALLEL_DEGREE"]
    assert load(env=env).config.parallel.tensor_parallel_degree == 2


def test_sm_num_gpus_zero_means_unset(load):
    resolved = load(env={"SM_NUM_GPUS": "0"})
    assert resolved.config.parallel.tensor_parallel_degree == 1
    assert resolved.sources["tensor_parallel_degree"] == "default"


def test_api_key_from_environment_is_secret(load):
    resolved = load(env={"NEURON_LMI_API_KEY": "s3cr3t"})
    assert resolved.sources["api_key"] == "env:NEURON_LMI_API_KEY"
    assert resolved.config.server.api_key is not None
    assert resolved.config.server.api_key.get_secret_value() == "s3cr3t"
    assert "s3cr3t" not in repr(resolved.config)


@pytest.mark.parametrize("name", ["n_positions", "n-positions", "option.n_positions", "OPTION.N_POSITIONS"])
def test_cli_accepts_field_and_lmi_names(load, name):
    resolved = load(cli={name: 1024})
    assert resolved.config.batching.n_positions == 1024
    assert resolved.sources["n_positions"] == "cli"


def test_cli_none_values_are_skipped_and_unknown_names_rejected(load):
    assert load(cli={"port": None}).sources["port"] == "default"
    with pytest.raises(ConfigError, match="no_such_option"):
        load(cli={"no_such_option": 1})


def test_cli_overrides_picks_config_fields_from_a_namespace():
    args = argparse.Namespace(command="serve", port=9000, dtype=None, tensor_parallel_degree="2", func=print)
    assert cli_overrides(args) == {"port": 9000, "tensor_parallel_degree": "2"}


def test_unsupported_keys_are_listed_and_logged_once(load, write_props, caplog):
    props = write_props(
        "engine=Python\noption.entryPoint=djl_python.transformers_neuronx\noption.model_id=/m\n"
        "option.paged_attention=true\nminWorkers=1\n"
    )
    env = {"OPTION_LOAD_SPLIT_MODEL": "true", "SERVING_OPTS": "-Xmx1g", "UNRELATED": "x"}
    with caplog.at_level(logging.WARNING, logger="neuron_lmi.config"):
        resolved = load(properties=props, env=env)
    expected = (
        "OPTION_LOAD_SPLIT_MODEL",
        "SERVING_OPTS",
        "minWorkers",
        "option.entryPoint",
        "option.paged_attention",
    )
    assert sorted(resolved.ignored_keys) == sorted(expected)
    assert resolved.ignored["option.entryPoint"] == f"serving.properties:{props}"
    assert resolved.ignored["SERVING_OPTS"] == "env:SERVING_OPTS"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert all(name in warnings[0].getMessage() for name in expected)


def test_no_warning_without_unsupported_keys(load, caplog):
    with caplog.at_level(logging.WARNING, logger="neuron_lmi.config"):
        assert load(env={"OPTION_DTYPE": "bf16"}).ignored_keys == ()
    assert not caplog.records


def test_properties_format(tmp_path: Path):
    text = (
        "# a comment\n! another\n\n  engine = Python  \noption.model_id: s3://bucket/model#1\n"
        "option.context_length_estimate=128,\\\n    256\noption.dtype=fp16\noption.dtype=bf16\n"
    )
    assert parse_properties(text, "test") == {
        "engine": "Python",
        "option.model_id": "s3://bucket/model#1",
        "option.context_length_estimate": "128,256",
        "option.dtype": "bf16",
    }


def test_properties_line_without_separator_names_the_line():
    with pytest.raises(ConfigError, match=r"line 2.*serving\.properties:x.*key=value"):
        parse_properties("engine=Python\njust words\n", "serving.properties:x")


def test_enforce_eager_from_every_place_and_released_to_vllm(load, write_props):
    """``option.enforce_eager`` turns off the CPU engine's compiled decode (``serve --enforce-eager``,
    ``OPTION_ENFORCE_EAGER``); when vLLM serves, the key is vLLM's own engine argument instead."""
    assert load().config.model.enforce_eager is False
    assert load(env={"OPTION_ENFORCE_EAGER": "true"}).config.model.enforce_eager is True
    resolved = load(cli={"enforce_eager": True}, properties=write_props("option.enforce_eager=false\n"))
    assert resolved.config.model.enforce_eager is True and resolved.sources["enforce_eager"] == "cli"
    with pytest.raises(ConfigError, match="OPTION_ENFORCE_EAGER='sometimes'"):
        load(env={"OPTION_ENFORCE_EAGER": "sometimes"})
    vllm = load(properties=write_props("option.rolling_batch=vllm\noption.enforce_eager=true\n", "v"))
    assert "enforce_eager" in vllm.backend_options and vllm.config.model.enforce_eager is False
