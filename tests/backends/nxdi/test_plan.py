"""NxD Inference argument mapping: representative serving.properties files -> exact constructor arguments.

Runs without any Neuron package (the mapping is pure); the published configs below are the models'
own ``config.json`` fields that the mapping reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.nxdi.plan import NEURON_CONFIG_FIELDS, plan_nxdi
from neuron_lmi.config import load_config

LLAMA_2_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "torch_dtype": "float16",
}  # fmt: skip
MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "sliding_window": 4096, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
    "max_position_embeddings": 32768, "sliding_window": None, "rope_theta": 1e6, "torch_dtype": "bfloat16",
}  # fmt: skip
LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}  # fmt: skip

LLAMA_3_3_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}  # fmt: skip
# AWS's Llama-3.3-70B card, trn2 config1/config2: tp 64 (LNC 2), its buckets up to 16384.
TRN2_TUNED_70B = (
    "option.tensor_parallel_degree=64\noption.max_rolling_batch_size=8\noption.n_positions=16384\n"
    "option.context_length_estimate=256,512,1024,2048,4096,8192,10240,12288\noption.nxdi_profile=trn2-tuned\n"
)


def model_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    """A checkpoint folder with only config.json: the mapping must not need weights."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def plan_for(tmp_path: Path, config: dict[str, Any], properties: str) -> Any:
    folder = model_dir(tmp_path, config)
    props = tmp_path / "serving.properties"
    props.write_text(f"option.model_id={folder}\n{properties}", encoding="utf-8")
    resolved = load_config(properties_path=props, env={})
    return plan_nxdi(resolved.config, config, str(folder)), resolved


def test_llama_2_70b_tp24_on_inf2_48xlarge(tmp_path: Path) -> None:
    plan, _ = plan_for(
        tmp_path,
        LLAMA_2_70B,
        "option.model_loader=nxdi\noption.tensor_parallel_degree=24\noption.max_rolling_batch_size=4\n"
        "option.dtype=fp16\n",
    )
    kwargs = plan.kwargs()
    assert kwargs == {
        "tp_degree": 24, "batch_size": 4, "max_batch_size": 4, "tkg_batch_size": 4, "ctx_batch_size": 1,
        "is_continuous_batching": True, "seq_len": 4096, "max_context_length": 4096,
        "torch_dtype": torch.float16, "enable_bucketing": True,
        "context_encoding_buckets": [128, 256, 512, 1024, 2048, 4096],
        "token_generation_buckets": [128, 256, 512, 1024, 2048, 4096],
        "fused_qkv": True, "padding_side": "right", "save_sharded_checkpoint": False,
        "on_device_sampling_config": {  # AWS's serving default, with logits kept for the host
            "dynamic": True, "do_sample": True, "deterministic": False, "global_topk": 256,
        },
        "output_logits": True,
    }  # fmt: skip
    assert kwargs["torch_dtype"] is torch.float16  # a dtype object: NxD Inference refuses "fp16"
    assert plan.application.application == "NeuronLlamaForCausalLM"
    assert plan.application.inference_config == "LlamaInferenceConfig"
    assert plan.application.neuron_config_cls == "NeuronConfig"
    assert plan.ignored == {}


def test_mistral_7b_tp8_bf16_with_lmi_keys(tmp_path: Path) -> None:
    plan, _ = plan_for(
        tmp_path,
        MISTRAL_7B,
        "option.tensor_parallel_degree=8\noption.max_rolling_batch_size=32\noption.dtype=bf16\n"
        "option.n_positions=4096\noption.context_length_estimate=256,512,1024\n"
        "option.group_query_attention=shard-over-heads\noption.quantize=int8\n",
    )
    kwargs = plan.kwargs()
    assert kwargs["torch_dtype"] is torch.bfloat16
    assert kwargs["tp_degree"] == 8 and kwargs["batch_size"] == 32 and kwargs["ctx_batch_size"] == 1
    # The estimates plus n_positions: a 3,000-token prompt is still one context-encoding call.
    assert kwargs["context_encoding_buckets"] == [256, 512, 1024, 4096]
    assert kwargs["token_generation_buckets"] == [128, 256, 512, 1024, 2048, 4096]
    assert kwargs["fused_qkv"] is False  # 0.9's Mistral application keeps q/k/v apart (defaults.py)
    assert kwargs["quantized"] is True
    assert kwargs["quantization_dtype"] == "int8"
    assert kwargs["quantization_type"] == "per_channel_symmetric"
    assert plan.application.application == "NeuronMistralForCausalLM"
    assert "option.group_query_attention" in plan.ignored


def test_mixtral_8x7b_tp32_on_trn1_uses_moe_config(tmp_path: Path) -> None:
    plan, _ = plan_for(
        tmp_path,
        MIXTRAL_8X7B,
        "option.tensor_parallel_degree=32\noption.max_rolling_batch_size=8\noption.dtype=bf16\n"
        "option.n_positions=2048\n",
    )
    kwargs = plan.kwargs()
    assert plan.application.neuron_config_cls == "MoENeuronConfig"
    assert plan.application.application == "NeuronMixtralForCausalLM"
    assert plan.application.inference_config == "MixtralInferenceConfig"
    assert kwargs["tp_degree"] == 32 and kwargs["seq_len"] == 2048 and kwargs["max_context_length"] == 2048
    assert kwargs["context_encoding_buckets"] == [128, 256, 512, 1024, 2048]


def test_llama_3_8b_on_trn2_with_logical_nc_config_and_override(tmp_path: Path) -> None:
    plan, _ = plan_for(
        tmp_path,
        LLAMA_3_8B,
        "option.tensor_parallel_degree=32\noption.max_rolling_batch_size=16\noption.dtype=bf16\n"
        "option.logical_nc_config=2\n"
        'option.override_neuron_config={"fused_qkv": true, "qkv_kernel_enabled": true, "not_a_field": 1}\n',
    )
    kwargs = plan.kwargs()
    assert kwargs["logical_nc_config"] == 2
    assert kwargs["seq_len"] == 4096  # LMI's smart default min(8192, 4096)
    assert kwargs["fused_qkv"] is True and kwargs["qkv_kernel_enabled"] is True  # merged last
    assert kwargs["not_a_field"] == 1  # passed as asked, but named at start-up:
    assert "override_neuron_config.not_a_field" in plan.ignored
    assert "override_neuron_config.qkv_kernel_enabled" not in plan.ignored


def test_environment_only_deployment(tmp_path: Path) -> None:
    folder = model_dir(tmp_path, LLAMA_3_8B)
    env = {
        "HF_MODEL_ID": str(folder),
        "OPTION_MODEL_LOADER": "nxdi",
        "OPTION_TENSOR_PARALLEL_DEGREE": "8",
        "OPTION_N_POSITIONS": "1024",
        "OPTION_DTYPE": "bf16",
        "NEURON_LOGICAL_NC_CONFIG": "2",
        "OPTION_OVERRIDE_NEURON_CONFIG": '{"skip_warmup": true}',
    }
    resolved = load_config(env=env)
    plan = plan_nxdi(resolved.config, LLAMA_3_8B, str(folder))
    assert resolved.config.neuron.model_loader == "nxdi"
    assert plan.neuron_config["logical_nc_config"] == 2
    assert plan.neuron_config["skip_warmup"] is True
    assert plan.neuron_config["token_generation_buckets"][-1] == 1024


def test_max_tp_needs_the_core_count(tmp_path: Path) -> None:
    folder = model_dir(tmp_path, LLAMA_3_8B)
    resolved = load_config({"tensor_parallel_degree": "max", "model_id": str(folder)}, env={})
    with pytest.raises(ValueError, match="visible NeuronCores"):
        plan_nxdi(resolved.config, LLAMA_3_8B, str(folder))
    assert plan_nxdi(resolved.config, LLAMA_3_8B, str(folder), tp_degree=24).tp_degree == 24


@pytest.mark.parametrize(
    ("properties", "message"),
    [
        ("option.quantize=int4\n", "int4 is not supported"),
        ('option.override_neuron_config={"max_context_length": 999999}\n', "max_context_length"),
        ('option.override_neuron_config={"ctx_batch_size": 4}\n', "ctx_batch_size"),
    ],
)
def test_refusals_name_the_key(tmp_path: Path, properties: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_for(tmp_path, LLAMA_2_70B, "option.tensor_parallel_degree=8\n" + properties)


def test_unsupported_model_type_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gpt2"):
        plan_for(tmp_path, {**LLAMA_2_70B, "model_type": "gpt2"}, "option.tensor_parallel_degree=8\n")


def test_override_must_be_a_json_object(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="override_neuron_config"):
        plan_for(tmp_path, LLAMA_2_70B, "option.override_neuron_config=[1, 2]\n")


def test_every_mapped_key_is_a_neuron_config_field(tmp_path: Path) -> None:
    plan, _ = plan_for(
        tmp_path,
        MIXTRAL_8X7B,
        "option.tensor_parallel_degree=32\noption.quantize=fp8\noption.on_device_sampling=true\n"
        "option.logical_nc_config=2\noption.save_sharded_checkpoint=true\n",
    )
    assert set(plan.neuron_config) <= NEURON_CONFIG_FIELDS
    assert plan.neuron_config["quantization_dtype"] == "f8e4m3"
    assert plan.on_device_sampling
