"""``neuron-lmi compile --target neuron --dry-run --json``: the review of a compile before paying for it.

Runs in a subprocess so the test can also check that no Neuron package was imported, from a model
folder that holds only ``config.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

NEURON_MODULES = ("neuronx_distributed", "transformers_neuronx", "torch_neuronx", "neuronxcc", "vllm_neuron")
LLAMA_2_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
}  # fmt: skip
DRIVER = """
import json, sys
from neuron_lmi.cli import main
code = main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {modules!r})
print(json.dumps({{"code": code, "neuron_modules": loaded}}), file=sys.stderr)
"""


def dry_run(model: Path, *flags: str) -> tuple[dict[str, Any], dict[str, Any]]:
    args = ["compile", "--target", "neuron", "--dry-run", "--json", "--model", str(model), *flags]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER.format(modules=NEURON_MODULES), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    status = json.loads(proc.stderr.strip().splitlines()[-1])
    assert status["code"] == 0, proc.stderr
    return json.loads(proc.stdout), status


@pytest.fixture()
def config_only(tmp_path: Path) -> Path:
    folder = tmp_path / "Llama-2-70b-hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_2_70B), encoding="utf-8")
    return folder


def test_nxdi_dry_run_prints_the_exact_arguments_and_key(config_only: Path) -> None:
    out, status = dry_run(
        config_only, "--tensor-parallel-degree", "24", "--max-rolling-batch-size", "4", "--dtype", "fp16"
    )
    assert status["neuron_modules"] == []
    assert out["model_loader"] == "nxdi"
    assert out["application_class"].endswith("modeling_llama.NeuronLlamaForCausalLM")
    assert out["inference_config_class"].endswith("modeling_llama.LlamaInferenceConfig")
    assert out["neuron_config_class"].endswith("models.config.NeuronConfig")
    kwargs = out["neuron_config_kwargs"]
    assert kwargs["tp_degree"] == 24 and kwargs["batch_size"] == 4 and kwargs["ctx_batch_size"] == 1
    assert kwargs["torch_dtype"] == "torch.float16"
    assert kwargs["context_encoding_buckets"][-1] == kwargs["seq_len"] == 4096
    inputs = out["cache_key_inputs"]
    assert inputs["library_args"]["neuron_config"]["tp_degree"] == 24
    assert len(out["cache_key"]) == 24

    other, _ = dry_run(
        config_only, "--tensor-parallel-degree", "8", "--max-rolling-batch-size", "4", "--dtype", "fp16"
    )
    assert other["cache_key"] != out["cache_key"]


def test_tnx_dry_run_from_config_only(config_only: Path) -> None:
    out, status = dry_run(config_only, "--model-loader", "tnx", "--tensor-parallel-degree", "24")
    assert status["neuron_modules"] == []
    assert out["model_loader"] == "tnx"
    assert out["application_class"] == "transformers_neuronx.llama.model.LlamaForSampling"
    assert out["from_pretrained_kwargs"]["tp_degree"] == 24
    assert out["cache_key_inputs"]["tensor_parallel_degree"] == 24


def test_the_dry_run_says_which_release_its_kwargs_are_for(config_only: Path) -> None:
    """No Neuron package here: the kwargs are for the release the platform runs, and it says so."""
    nxdi, _ = dry_run(config_only, "--tensor-parallel-degree", "24")
    assert (nxdi["library_version"], nxdi["library_version_source"]) == (
        "0.9.0",
        "assumed: not installed, platform unknown",
    )
    env_driver = dict(os.environ, NEURON_PLATFORM_TARGET_OVERRIDE="inf2")
    args = ["compile", "--target", "neuron", "--dry-run", "--json", "--model", str(config_only)]
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_lmi.cli", *args, "--tensor-parallel-degree", "24"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_driver,
        check=True,
    )
    inf2 = json.loads(proc.stdout)
    assert inf2["library_version"] == "0.8.0" and "inf2" in inf2["library_version_source"]
    tnx, _ = dry_run(config_only, "--model-loader", "tnx", "--tensor-parallel-degree", "24")
    assert tnx["library_version"] == "0.13" and "SDK <= 2.25" in tnx["library_version_source"]


def test_dry_run_needs_config_json(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "neuron_lmi.cli", "compile", "--target", "neuron", "--dry-run", "--model",
         str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "config.json" in proc.stderr
