"""(c) Every mapping we ship is taken by the real ``NeuronConfig``/``MoENeuronConfig`` and application.

Representative deployments (Llama-2-70B at tp 24 on inf2, Mistral-7B with int8 weights and LMI keys,
Mixtral-8x7B at tp 32, Llama-3-8B on trn2 with LNC 2 and overrides, on-device sampling, AWS's tuned
trn2 set for Llama-3.3-70B (``option.nxdi_profile=trn2-tuned``), the CPU mode, Qwen2.5-7B, Qwen3-8B,
Qwen3-30B-A3B and, from 0.9, Gemma-3-27B's vision-language checkpoint) are planned for the release
under test and built through ``new_application`` from a folder holding only ``config.json``: the
library must log no "Unexpected keyword arguments" and keep every value. Run the tier once per release
(0.9.0 = 4bcdc54, 0.8.0 = cd3abf3) to check both.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.nxdi.artifacts import new_application
from neuron_lmi.backends.nxdi.model_checks import text_config
from neuron_lmi.backends.nxdi.plan import plan_nxdi
from neuron_lmi.backends.nxdi.support import UnsupportedReleaseError
from neuron_lmi.config import load_config
from tests.backends.nxdi.test_families import GEMMA_3_27B, QWEN2_5_7B, QWEN3_8B, QWEN3_30B_A3B
from tests.backends.nxdi.test_plan import (
    LLAMA_2_70B,
    LLAMA_3_3_70B,
    LLAMA_3_8B,
    MISTRAL_7B,
    MIXTRAL_8X7B,
    TRN2_TUNED_70B,
    model_dir,
)
from tests.backends.nxdi_library import library
from tests.backends.nxdi_library.conftest import ARCHES

BASE = "option.model_loader=nxdi\n"
DEPLOYMENTS = {
    "llama-2-70b-inf2-tp24": (
        LLAMA_2_70B,
        "option.tensor_parallel_degree=24\noption.max_rolling_batch_size=4\noption.dtype=fp16\n",
    ),
    "mistral-7b-int8-lmi-keys": (
        MISTRAL_7B,
        "option.tensor_parallel_degree=8\noption.max_rolling_batch_size=32\noption.dtype=bf16\n"
        "option.n_positions=4096\noption.context_length_estimate=256,512,1024\n"
        "option.group_query_attention=shard-over-heads\noption.quantize=int8\n",
    ),
    "mixtral-8x7b-tp32": (
        MIXTRAL_8X7B,
        "option.tensor_parallel_degree=32\noption.max_rolling_batch_size=8\noption.dtype=bf16\n"
        "option.n_positions=2048\n",
    ),
    "llama-3-8b-trn2-lnc2": (
        LLAMA_3_8B,
        "option.tensor_parallel_degree=32\noption.max_rolling_batch_size=16\noption.dtype=bf16\n"
        'option.logical_nc_config=2\noption.override_neuron_config={"qkv_kernel_enabled": true}\n',
    ),
    "llama-3-8b-on-device-sampling": (
        LLAMA_3_8B,
        "option.tensor_parallel_degree=8\noption.max_rolling_batch_size=8\noption.dtype=bf16\n"
        "option.on_device_sampling=true\noption.n_positions=1024\n",
    ),
    "llama-3-8b-host-sampling": (
        LLAMA_3_8B,
        "option.tensor_parallel_degree=8\noption.max_rolling_batch_size=8\noption.dtype=bf16\n"
        "option.on_device_sampling=false\noption.n_positions=1024\n",
    ),
    "llama-3.3-70b-trn2-tuned": (LLAMA_3_3_70B, TRN2_TUNED_70B),
    "mistral-7b-on-cpu": (
        MISTRAL_7B,
        "option.tensor_parallel_degree=1\noption.max_rolling_batch_size=2\noption.dtype=fp32\n"
        'option.n_positions=256\noption.override_neuron_config={"on_cpu": true}\n',
    ),
    "qwen2.5-7b-tp4": (
        QWEN2_5_7B,
        "option.tensor_parallel_degree=4\noption.max_rolling_batch_size=8\noption.n_positions=4096\n",
    ),
    "qwen3-8b-tp8": (QWEN3_8B, "option.tensor_parallel_degree=8\noption.max_rolling_batch_size=8\n"),
    "qwen3-30b-a3b-tp16": (
        QWEN3_30B_A3B,
        "option.tensor_parallel_degree=16\noption.max_rolling_batch_size=8\noption.n_positions=4096\n",
    ),
}
if "gemma3" in ARCHES:  # 0.9+: within its sliding window of 1024
    DEPLOYMENTS["gemma-3-27b-tp16"] = (
        GEMMA_3_27B,
        "option.tensor_parallel_degree=16\noption.max_rolling_batch_size=8\noption.n_positions=1024\n",
    )


def plan_for(tmp_path: Path, config: dict[str, Any], properties: str) -> Any:
    folder = model_dir(tmp_path, config)
    props = tmp_path / "serving.properties"
    props.write_text(f"option.model_id={folder}\n{BASE}{properties}", encoding="utf-8")
    resolved = load_config(properties_path=props, env={})
    version = library.library_version()
    try:
        return plan_nxdi(resolved.config, config, str(folder), None, version, None)
    except UnsupportedReleaseError:  # Mixtral on 0.9+: the same keywords, checked under 0.8's mapping
        assert config["model_type"] == "mixtral"
        return plan_nxdi(resolved.config, config, str(folder), None, "0.8.0", None)


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_the_library_takes_every_keyword_we_pass(
    name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config, properties = DEPLOYMENTS[name]
    plan = plan_for(tmp_path, config, properties)
    # nothing else dropped or refused (config.json fields an application does not honour: model_checks)
    assert {k for k in plan.ignored if not k.startswith("config.json ")} <= {"option.group_query_attention"}
    with caplog.at_level(logging.DEBUG):
        app = new_application(plan, quantized_dir=tmp_path / "quantized")
    unexpected = [r.getMessage() for r in caplog.records if "Unexpected keyword" in r.getMessage()]
    assert unexpected == []
    built = app.config.neuron_config
    for key, value in plan.kwargs().items():
        if key in ("on_device_sampling_config", "quantized_checkpoints_path"):
            continue
        assert getattr(built, key) == value, key
    if plan.on_device_sampling:  # every key of ours is an OnDeviceSamplingConfig attribute, as given
        sampling = built.on_device_sampling_config
        for key, value in plan.neuron_config["on_device_sampling_config"].items():
            assert getattr(sampling, key) == value, key
        assert built.output_logits is True and plan.device_sampling() is not None
    text = text_config(config)
    assert app.config.head_dim == text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])
    assert built.torch_dtype == plan.kwargs()["torch_dtype"]
    assert isinstance(built.torch_dtype, torch.dtype)


def test_an_unknown_override_is_reported_not_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What NxD Inference itself only logs (so the check above can fail): our plan names it."""
    plan = plan_for(
        tmp_path,
        LLAMA_3_8B,
        'option.tensor_parallel_degree=8\noption.override_neuron_config={"not_a_key": 1}\n',
    )
    assert list(plan.ignored) == ["override_neuron_config.not_a_key"]
    assert library.library_version() in plan.ignored["override_neuron_config.not_a_key"]
    with caplog.at_level(logging.DEBUG):
        new_application(plan)
    assert any(
        "Unexpected keyword arguments" in r.getMessage() and "not_a_key" in r.getMessage()
        for r in caplog.records
    )
