"""The SageMaker model directory: serving.properties beside (maybe) the weights in /opt/ml/model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neuron_lmi.config import load_config, sagemaker_model_dir, sagemaker_root


def make_model_dir(root: Path, properties: str | None, weights: str | None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if properties is not None:
        (root / "serving.properties").write_text(properties)
    if weights == "hf":
        (root / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
        (root / "model.safetensors").write_bytes(b"")
    elif weights == "gguf":
        (root / "model.gguf").write_bytes(b"GGUF")
    return root


def test_default_model_dir_is_opt_ml_model():
    assert sagemaker_root({}) == Path("/opt/ml")
    assert sagemaker_model_dir({}) == Path("/opt/ml/model")
    # the SageMaker root can be moved (tests, local rehearsals); SM_MODEL_DIR still names the folder
    assert sagemaker_model_dir({"NEURON_LMI_SAGEMAKER_ROOT": "/tmp/sm"}) == Path("/tmp/sm/model")
    assert sagemaker_model_dir({"SM_MODEL_DIR": "/x", "NEURON_LMI_SAGEMAKER_ROOT": "/tmp/sm"}) == Path("/x")


def test_env_only_deployment_reads_the_sagemaker_root_without_sm_model_dir(tmp_path: Path):
    """What SageMaker hosting gives: /opt/ml/model with the weights, options in OPTION_* variables,
    no serving.properties and no SM_MODEL_DIR (a training variable)."""
    root = tmp_path / "opt" / "ml"
    sm = make_model_dir(root / "model", None, "hf")
    env = {"NEURON_LMI_SAGEMAKER_ROOT": str(root), "OPTION_MAX_ROLLING_BATCH_SIZE": "4"}
    env["OPTION_N_POSITIONS"] = "256"
    resolved = load_config({}, None, env)
    assert resolved.config.model.model_id == str(sm)
    assert resolved.sources["model_id"] == f"model_dir:{sm}"
    assert resolved.properties_path is None
    assert resolved.config.batching.max_rolling_batch_size == 4
    assert resolved.sources["n_positions"] == "env:OPTION_N_POSITIONS"
    with_hub_id = load_config({}, None, {**env, "HF_MODEL_ID": "org/model"})  # HF_MODEL_ID wins
    assert with_hub_id.config.model.model_id == "org/model"


def test_properties_and_weights_in_the_model_dir(tmp_path: Path):
    sm = make_model_dir(tmp_path / "ml", "engine=Python\noption.tensor_parallel_degree=2\n", "hf")
    resolved = load_config({}, None, {"SM_MODEL_DIR": str(sm)})
    assert resolved.properties_path == sm / "serving.properties"
    assert resolved.config.parallel.tensor_parallel_degree == 2
    assert resolved.sources["tensor_parallel_degree"] == f"serving.properties:{sm / 'serving.properties'}"
    assert resolved.config.model.model_id == str(sm)
    assert resolved.sources["model_id"] == f"model_dir:{sm}"
    assert resolved.config.batching.n_positions == 4096  # min(8192, 4096) from the model's config.json


def test_gguf_weights_make_the_dir_the_model(tmp_path: Path):
    sm = make_model_dir(tmp_path / "ml", None, "gguf")
    resolved = load_config({}, None, {"SM_MODEL_DIR": str(sm)})
    assert resolved.config.model.model_id == str(sm)
    assert resolved.properties_path is None


@pytest.mark.parametrize(
    ("where", "expected_source"),
    [("properties", "serving.properties:"), ("env", "env:HF_MODEL_ID"), ("cli", "cli")],
)
def test_an_explicit_model_id_wins_over_the_weights(tmp_path: Path, where: str, expected_source: str):
    props = "option.model_id=s3://bucket/llama\n" if where == "properties" else "engine=Python\n"
    sm = make_model_dir(tmp_path / "ml", props, "hf")
    env = {"SM_MODEL_DIR": str(sm), **({"HF_MODEL_ID": "s3://bucket/llama"} if where == "env" else {})}
    cli = {"model_id": "s3://bucket/llama"} if where == "cli" else {}
    resolved = load_config(cli, None, env)
    assert resolved.config.model.model_id == "s3://bucket/llama"
    assert resolved.sources["model_id"].startswith(expected_source)


def test_properties_only_model_dir(tmp_path: Path):
    sm = make_model_dir(tmp_path / "ml", "option.model_id=org/model\noption.dtype=bf16\n", None)
    resolved = load_config({}, None, {"SM_MODEL_DIR": str(sm)})
    assert resolved.config.model.model_id == "org/model"
    assert resolved.config.batching.n_positions is None  # not known until the model is fetched


def test_explicit_properties_replace_the_model_dir_file(tmp_path: Path):
    sm = make_model_dir(tmp_path / "ml", "option.tensor_parallel_degree=8\n", None)
    mine = make_model_dir(tmp_path / "mine", "option.tensor_parallel_degree=2\n", "gguf")
    resolved = load_config({}, mine / "serving.properties", {"SM_MODEL_DIR": str(sm)})
    assert resolved.config.parallel.tensor_parallel_degree == 2
    assert resolved.config.model.model_id == str(mine)  # the properties file's folder holds weights


def test_properties_path_may_be_the_folder(tmp_path: Path):
    mine = make_model_dir(tmp_path / "mine", "option.n_positions=1024\n", None)
    resolved = load_config({}, mine, {"SM_MODEL_DIR": str(tmp_path / "none")})
    assert resolved.config.batching.n_positions == 1024


def test_missing_explicit_properties_file_is_an_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"serving\.properties not found"):
        load_config({}, tmp_path / "nope" / "serving.properties", {"SM_MODEL_DIR": str(tmp_path)})


def test_no_model_dir_leaves_model_unset(tmp_path: Path):
    resolved = load_config({}, None, {"SM_MODEL_DIR": str(tmp_path / "absent")})
    assert resolved.config.model.model_id is None
    assert resolved.sources["model_id"] == "default"
