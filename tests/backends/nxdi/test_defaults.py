"""AWS's NxD Inference serving defaults and the tuned trn2 set, as the plan applies them (no library).

The real ``NeuronConfig`` and weight conversion check the same plans in tests/backends/nxdi_library
(``test_aws_defaults.py``, ``test_neuron_config_kwargs.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from neuron_lmi.backends.nxdi.defaults import PROFILE_LEFT_OUT, TRN2_TUNED, apply_environment
from neuron_lmi.backends.nxdi.plan import plan_nxdi
from neuron_lmi.backends.nxdi.support import Platform
from neuron_lmi.config import load_config
from tests.backends.nxdi.test_plan import (
    LLAMA_2_70B,
    LLAMA_3_3_70B,
    LLAMA_3_8B,
    MISTRAL_7B,
    MIXTRAL_8X7B,
    TRN2_TUNED_70B,
    model_dir,
)

TRN2 = Platform("trn2", "option.neuron_platform")


def plan(
    tmp_path: Path,
    config: dict[str, Any],
    properties: str,
    version: str | None = None,
    platform: Platform | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    folder = model_dir(tmp_path, config)
    props = tmp_path / "serving.properties"
    props.write_text(
        f"option.model_id={folder}\noption.tensor_parallel_degree=8\n{properties}", encoding="utf-8"
    )
    resolved = load_config(properties_path=props, env=env or {})
    return plan_nxdi(resolved.config, config, str(folder), None, version, platform)


@pytest.mark.parametrize(
    ("config", "properties", "env", "dtype", "source"),
    [
        (LLAMA_3_8B, "", {}, "bf16", "config.json torch_dtype=bfloat16 (option.dtype unset)"),
        (LLAMA_2_70B, "", {}, "fp16", "config.json torch_dtype=float16 (option.dtype unset)"),
        (
            {**LLAMA_3_8B, "torch_dtype": None, "dtype": "float32"},
            "",
            {},
            "fp32",
            "config.json dtype=float32",
        ),
        ({**LLAMA_3_8B, "torch_dtype": None}, "", {}, "bf16", "default bf16: option.dtype unset"),
        (LLAMA_3_8B, "option.dtype=fp16\n", {}, "fp16", "option.dtype"),
        (LLAMA_3_8B, "", {"OPTION_DTYPE": "fp32"}, "fp32", "option.dtype"),
    ],
)
def test_the_dtype_is_the_checkpoints_when_option_dtype_is_unset(
    tmp_path: Path, config: dict[str, Any], properties: str, env: dict[str, str], dtype: str, source: str
) -> None:
    planned = plan(tmp_path, config, properties, env=env)
    assert planned.dtype == dtype and planned.dtype_source.startswith(source)
    assert (
        planned.describe()["neuron_config_kwargs"]["torch_dtype"]
        == {
            "fp32": "torch.float32",
            "bf16": "torch.bfloat16",
            "fp16": "torch.float16",
        }[dtype]
    )


def test_an_override_dtype_is_what_the_plan_reports(tmp_path: Path) -> None:
    planned = plan(tmp_path, LLAMA_3_8B, 'option.override_neuron_config={"torch_dtype": "float32"}\n')
    assert (planned.dtype, planned.dtype_source) == ("fp32", "override")


def test_cpu_mode_names_a_checkpoints_fp16(tmp_path: Path) -> None:
    props = 'option.tensor_parallel_degree=1\noption.override_neuron_config={"on_cpu": true}\n'
    with pytest.raises(ValueError, match=r"refuses fp16 \(config.json torch_dtype=float16.*set option.dtype"):
        plan(tmp_path, LLAMA_2_70B, props)


@pytest.mark.parametrize(
    ("config", "version", "fused"),
    [
        (LLAMA_3_8B, "0.9.0", True),
        (LLAMA_3_8B, "0.8.0", True),
        (MISTRAL_7B, "0.8.0", True),  # on the Llama application
        (MISTRAL_7B, "0.9.0", False),  # NeuronMistralForCausalLM keeps q/k/v apart
        (MIXTRAL_8X7B, "0.8.0", False),
    ],
)
def test_fused_qkv_is_on_where_the_weight_conversion_fuses(
    tmp_path: Path, config: dict[str, Any], version: str, fused: bool
) -> None:
    assert plan(tmp_path, config, "", version).neuron_config["fused_qkv"] is fused


@pytest.mark.parametrize(
    ("config", "version", "properties", "key"),
    [
        (MISTRAL_7B, "0.9.0", "option.fuse_qkv=true\n", "option.fuse_qkv=True"),
        (
            MIXTRAL_8X7B,
            "0.8.0",
            'option.override_neuron_config={"fused_qkv": true}\n',
            "override_neuron_config.fused_qkv=True",
        ),
    ],
)
def test_fused_qkv_is_refused_where_the_library_keeps_qkv_apart(
    tmp_path: Path, config: dict[str, Any], version: str, properties: str, key: str
) -> None:
    with pytest.raises(ValueError, match=rf"{key}: NxD Inference {version}'s \w+ does not fuse Q/K/V"):
        plan(tmp_path, config, properties, version)


def test_every_default_stays_overridable(tmp_path: Path) -> None:
    props = 'option.override_neuron_config={"fused_qkv": false, "torch_dtype": "float16"}\n'
    kwargs = plan(tmp_path, LLAMA_3_8B, props).neuron_config
    assert kwargs["fused_qkv"] is False and kwargs["torch_dtype"] == "float16"
    (tmp_path / "b").mkdir()
    assert plan(tmp_path / "b", LLAMA_3_8B, "option.fuse_qkv=false\n").neuron_config["fused_qkv"] is False


@pytest.mark.parametrize(
    ("properties", "wanted"),
    [
        ("option.quantize=fp8\n", {"XLA_HANDLE_SPECIAL_SCALAR": "1"}),
        ('option.override_neuron_config={"kv_cache_quant": true}\n', {"XLA_HANDLE_SPECIAL_SCALAR": "1"}),
        ("option.quantize=int8\n", {}),
        ("", {}),
    ],
)
def test_fp8_or_a_quantized_kv_cache_sets_xla_handle_special_scalar(
    tmp_path: Path, properties: str, wanted: dict[str, str]
) -> None:
    planned = plan(tmp_path, LLAMA_3_8B, properties)
    assert planned.environment == wanted and planned.describe()["environment"] == wanted


def test_the_environment_keeps_what_the_user_set(caplog: pytest.LogCaptureFixture) -> None:
    env: dict[str, str] = {}
    apply_environment({"XLA_HANDLE_SPECIAL_SCALAR": "1"}, env)
    assert env == {"XLA_HANDLE_SPECIAL_SCALAR": "1"}
    mine = {"XLA_HANDLE_SPECIAL_SCALAR": "0"}
    apply_environment({"XLA_HANDLE_SPECIAL_SCALAR": "1"}, mine)
    assert mine == {"XLA_HANDLE_SPECIAL_SCALAR": "0"}
    assert "XLA_HANDLE_SPECIAL_SCALAR=0 is kept as set" in caplog.text


def test_the_trn2_tuned_profile_is_the_cards_set(tmp_path: Path) -> None:
    planned = plan(tmp_path, LLAMA_3_3_70B, TRN2_TUNED_70B, "0.9.0", TRN2)
    kwargs = planned.neuron_config
    assert {k: kwargs[k] for k in TRN2_TUNED} == dict(TRN2_TUNED)
    assert kwargs["tp_degree"] == 64 and kwargs["torch_dtype"] == "bfloat16"
    assert kwargs["context_encoding_buckets"] == [256, 512, 1024, 2048, 4096, 8192, 10240, 12288, 16384]
    assert "async_mode" not in kwargs  # on-device sampling is on for every target, not the profile's
    assert kwargs["on_device_sampling_config"]["dynamic"] is True and kwargs["output_logits"] is True
    described = planned.describe()
    assert described["profile"] == "trn2-tuned" and set(described["profile_left_out"]) == set(
        PROFILE_LEFT_OUT
    )


def test_explicit_keys_win_over_the_profile(tmp_path: Path) -> None:
    props = (
        TRN2_TUNED_70B
        + "option.logical_nc_config=1\n"
        + 'option.override_neuron_config={"k_cache_transposed": false}\n'
    )
    kwargs = plan(tmp_path, LLAMA_3_3_70B, props, "0.9.0", TRN2).neuron_config
    assert kwargs["logical_nc_config"] == 1 and kwargs["k_cache_transposed"] is False
    assert kwargs["qkv_kernel_enabled"] is True


@pytest.mark.parametrize("chip", ["inf2", "trn1"])
def test_the_profile_is_refused_on_inf2_and_trn1(tmp_path: Path, chip: str) -> None:
    with pytest.raises(
        ValueError, match=r"option\.nxdi_profile=trn2-tuned selects NKI kernels.*no longer supports NKI"
    ):
        plan(tmp_path, LLAMA_3_3_70B, TRN2_TUNED_70B, None, Platform(chip, "--platform"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("option.dtype=fp16\n", r"option\.nxdi_profile=trn2-tuned: its QKV and MLP kernels need bf16"),
        ('option.override_neuron_config={"on_cpu": true}\n', r"NKI kernels, which run on a NeuronCore"),
    ],
)
def test_the_profile_is_refused_off_bf16_and_in_cpu_mode(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan(tmp_path, LLAMA_3_3_70B, TRN2_TUNED_70B + extra, "0.9.0", TRN2)


@pytest.mark.parametrize(
    ("properties", "key"),
    [
        (TRN2_TUNED_70B + "option.context_length_estimate=100,1000\n", r"option\.nxdi_profile=trn2-tuned"),
        (
            'option.n_positions=4004\noption.override_neuron_config={"sequence_parallel_enabled": true}\n',
            r"override_neuron_config\.sequence_parallel_enabled=True",
        ),
    ],
)
def test_sequence_parallelism_needs_buckets_the_tp_degree_divides(
    tmp_path: Path, properties: str, key: str
) -> None:
    with pytest.raises(ValueError, match=rf"{key}: sequence parallelism .* not multiples of tensor_parallel"):
        plan(tmp_path, LLAMA_3_3_70B, properties, "0.9.0", TRN2)


def test_the_runner_reports_the_checkpoints_dtype(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """What /info reports as model_dtype, and the start-up log's reason for it."""
    import logging

    import torch

    from neuron_lmi.backends.nxdi.backend import build_nxdi_runner
    from neuron_lmi.backends.registry import BuildRequest
    from neuron_lmi.models import build_model
    from neuron_lmi.models.loader import load_checkpoint
    from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
    from neuron_lmi.testing.nxdi_contract import NxdiContractModel

    checkpoint = make_tiny_checkpoint(tmp_path / "llama", arch="llama")
    ckpt = load_checkpoint(checkpoint, dtype=torch.float32)
    contract = NxdiContractModel(build_model(ckpt.config, ckpt.state_dict, n_positions=64), 2, 64, (64,))
    props = tmp_path / "serving.properties"
    props.write_text("option.max_rolling_batch_size=2\noption.n_positions=64\n", encoding="utf-8")
    resolved = load_config(properties_path=props, env={})
    with caplog.at_level(logging.INFO, logger="neuron_lmi.backends.nxdi.backend"):
        runner = build_nxdi_runner(BuildRequest(resolved, {}, "neuron-nxdi", 1), checkpoint, model=contract)
    assert runner.dtype == "fp32"
    assert "fp32 (config.json dtype=float32 (option.dtype unset))" in caplog.text  # transformers 4.57
    assert "(assumed: not installed, platform unknown: no option.neuron_platform" in caplog.text
    assert "EC2 instance type) on an unknown platform" in caplog.text
