"""``--print-config`` text and ``write_properties`` for packaging."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_lmi.config import KEYS, ConfigError, format_config, load_config, read_properties, write_properties


def test_print_config_shows_every_value_and_source(load, write_props):
    props = write_props("engine=Python\noption.model_id=/models/llama\noption.entryPoint=x\n")
    env = {"OPTION_TENSOR_PARALLEL_DEGREE": "2", "NEURON_LMI_API_KEY": "hunter2-secret"}
    resolved = load(cli={"port": 9001}, properties=props, env=env)

    text = format_config(resolved)

    lines = {line.split()[0]: line for line in text.splitlines() if not line.startswith(("#", "ignored"))}
    assert set(lines) == {spec.path for spec in KEYS}
    assert "9001" in lines["server.port"] and lines["server.port"].endswith("<- cli")
    assert "/models/llama" in lines["model.model_id"]
    assert lines["model.model_id"].endswith(f"<- serving.properties:{props}")
    assert lines["parallel.tensor_parallel_degree"].endswith("<- env:OPTION_TENSOR_PARALLEL_DEGREE")
    assert lines["batching.max_rolling_batch_size"].endswith("<- default")
    assert "hunter2" not in text and "********" in lines["server.api_key"]
    assert f"ignored: option.entryPoint (from serving.properties:{props})" in text
    assert text.startswith(f"# read {props}")


def test_print_config_without_api_key_shows_a_dash(load):
    line = next(x for x in format_config(load()).splitlines() if x.startswith("server.api_key"))
    assert "********" not in line and " - " in line


def test_write_properties_from_a_mapping_round_trips(tmp_path: Path):
    path = tmp_path / "pkg" / "serving.properties"
    written = write_properties(
        {
            "model_id": "s3://bucket/llama",
            "option.tensor_parallel_degree": 8,
            "dtype": "bfloat16",
            "context_length_estimate": [128, 512],
            "fuse_qkv": True,
            "n_positions": 2048,
            "api_key": "never-written",
        },
        path,
    )
    text = path.read_text()
    assert text.splitlines()[1] == "engine=Python"  # after the header comment
    assert "never-written" not in text and "api_key" not in text
    assert read_properties(path) == written
    assert written["option.dtype"] == "bf16" and written["option.context_length_estimate"] == "128,512"
    assert written["option.fuse_qkv"] == "true"

    resolved = load_config({}, path, {"SM_MODEL_DIR": str(tmp_path / "none")})
    assert resolved.config.parallel.tensor_parallel_degree == 8
    assert resolved.config.batching.context_length_estimate == (128, 512)
    assert resolved.sources["dtype"] == f"serving.properties:{path}"
    assert resolved.ignored_keys == ()


def test_write_properties_from_a_resolved_config_writes_only_what_was_set(load, tmp_path: Path):
    resolved = load(env={"OPTION_MODEL_ID": "/m", "MAX_BATCH_SIZE": "4", "SERVING_FAIL_FAST": "1"})
    written = write_properties(resolved, tmp_path / "serving.properties")
    assert written == {
        "option.model_id": "/m",
        "option.max_rolling_batch_size": "4",
        "fail_fast": "true",
        "engine": "Python",
    }


def test_write_properties_from_a_config_object(load, tmp_path: Path):
    config = load(cli={"model_id": "/m", "port": 8081}).config
    written = write_properties(config, tmp_path / "serving.properties")
    assert written == {"option.model_id": "/m", "port": "8081", "engine": "Python"}


@pytest.mark.parametrize(
    ("values", "key"),
    [({"not_a_key": 1}, "not_a_key"), ({"tensor_parallel_degree": 0}, "tensor_parallel_degree=0")],
)
def test_write_properties_rejects_unknown_keys_and_bad_values(tmp_path: Path, values, key):
    path = tmp_path / "serving.properties"
    with pytest.raises(ConfigError) as info:
        write_properties(values, path)
    assert key in str(info.value) and "write_properties" in str(info.value)
    assert not path.exists()
