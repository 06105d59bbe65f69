"""vLLM on Neuron: the same ``VllmEngine``, configured for the vllm-neuron platform plugin. Checked
without vLLM or Neuron: the engine arguments and environment the builder hands vLLM."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpu_fallback.config import VllmEngineConfig, engine_args_kwargs
from gpu_fallback.neuron_platform import (
    ARTIFACTS_VAR,
    artifacts_dir,
    neuron_engine_args,
    neuron_platform_setup,
)
from neuron_lmi.backends import registry
from neuron_lmi.config import load_config
from tests.gpu_fallback.conftest import engine_config

VERSIONS = {
    "vllm": "0.11.0",
    "vllm-neuron": "0.2.0",
    "neuronx-distributed-inference": "0.6",
    "neuronx-cc": "2.21",
}


def _config(**changes) -> VllmEngineConfig:
    return engine_config(
        "/models/llama",
        tensor_parallel_degree=32,
        max_rolling_batch_size=8,
        n_positions=4096,
        **changes,
    )


def test_override_neuron_config_reaches_additional_config() -> None:
    extra = neuron_engine_args(_config(), {"skip_warmup": True, "fused_qkv": True})
    assert extra["additional_config"] == {"override_neuron_config": {"skip_warmup": True, "fused_qkv": True}}
    # Prefix caching off (the plugin asserts a block size otherwise) and one KV block per sequence.
    assert extra["enable_prefix_caching"] is False and extra["num_gpu_blocks_override"] == 8
    assert "device" not in extra  # the platform comes from the plugin's entry point


def test_user_engine_args_win_and_overrides_merge() -> None:
    user = {
        "additional_config": {"override_neuron_config": {"skip_warmup": False, "async_mode": True}},
        "enable_prefix_caching": True,
        "block_size": 32,
    }
    extra = neuron_engine_args(_config(extra_engine_args=user), {"skip_warmup": True})
    assert extra["additional_config"]["override_neuron_config"] == {"skip_warmup": True, "async_mode": True}
    assert extra["num_gpu_blocks_override"] == 4096 // 32 * 8  # the README's ceil(len/block) * seqs
    with pytest.raises(ValueError, match="block_size"):
        neuron_engine_args(_config(extra_engine_args={"enable_prefix_caching": True}), None)
    assert (
        neuron_engine_args(_config(extra_engine_args={"num_gpu_blocks_override": 9}), None)[
            "num_gpu_blocks_override"
        ]
        == 9
    )


def test_compiled_artifacts_folder(tmp_path: Path) -> None:
    given = neuron_platform_setup(_config(), None, "/opt/ml/model/compiled", {}, tmp_path, VERSIONS)
    assert given.env == {ARTIFACTS_VAR: "/opt/ml/model/compiled"}
    with pytest.raises(ValueError, match="local folder"):
        neuron_platform_setup(_config(), None, "s3://bucket/neff", {}, tmp_path, VERSIONS)
    # Unset: a folder of the writable cache named by the settings, never the model folder (which the
    # plugin would empty first, and which SageMaker mounts read-only).
    a = neuron_platform_setup(
        _config(), {"fused_qkv": True}, None, {"model_type": "llama"}, tmp_path, VERSIONS
    )
    again = neuron_platform_setup(
        _config(), {"fused_qkv": True}, None, {"model_type": "llama"}, tmp_path, VERSIONS
    )
    other = neuron_platform_setup(
        _config(), {"fused_qkv": False}, None, {"model_type": "llama"}, tmp_path, VERSIONS
    )
    assert a.env == again.env != other.env
    assert Path(a.env[ARTIFACTS_VAR]).parent == tmp_path / "vllm-neuron"
    newer = artifacts_dir(_config(), {}, {}, tmp_path, {**VERSIONS, "vllm-neuron": "0.3.0"})
    assert newer != artifacts_dir(_config(), {}, {}, tmp_path, VERSIONS)


def test_vllm_neuron_builder(monkeypatch, tmp_path, tiny_llama_dir) -> None:
    props = tmp_path / "serving.properties"
    props.write_text(
        f"option.model_id={tiny_llama_dir}\noption.rolling_batch=vllm\noption.max_rolling_batch_size=4\n"
        'option.override_neuron_config={"skip_warmup": true}\n'
    )
    resolved = load_config(properties_path=props, env={})
    import gpu_fallback.config

    # vLLM is not installed here: stand in for AsyncEngineArgs' field types (the pass-through reads them).
    fields = {"enable_prefix_caching": bool, "block_size": int, "num_gpu_blocks_override": int}
    monkeypatch.setattr(gpu_fallback.config, "engine_arg_types", lambda: fields)
    monkeypatch.setenv("NEURON_LMI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(ARTIFACTS_VAR, "unset-after-the-test")  # so the builder's value is undone
    monkeypatch.delenv(ARTIFACTS_VAR)
    request = registry.BuildRequest(resolved, {}, "vllm-neuron", 24)
    engine = registry.get("vllm-neuron")(request)

    assert engine.config.tensor_parallel_degree == 24 and engine.config.max_rolling_batch_size == 4
    kwargs = engine_args_kwargs(engine.config, tiny_llama_dir)
    assert kwargs["tensor_parallel_size"] == 24 and kwargs["max_num_seqs"] == 4
    assert kwargs["additional_config"] == {"override_neuron_config": {"skip_warmup": True}}
    assert kwargs["enable_prefix_caching"] is False and kwargs["num_gpu_blocks_override"] == 4
    # Set in this process before vLLM starts, so its engine process inherits it.
    assert os.environ[ARTIFACTS_VAR].startswith(str(tmp_path / "cache" / "vllm-neuron"))
