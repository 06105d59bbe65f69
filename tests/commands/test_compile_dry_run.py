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
    assert nxdi["library_version"] == "0.9.0"
    assert nxdi["library_version_source"].startswith("assumed: not installed, platform unknown")
    assert nxdi["platform"] is None
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


MISTRAL_7B = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "sliding_window": 4096, "torch_dtype": "bfloat16",
}  # fmt: skip


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuron_lmi.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "NEURON_PLATFORM_TARGET_OVERRIDE"} | (env or {}),
        check=False,
    )


def test_a_named_platform_reviews_that_releases_kwargs(tmp_path: Path) -> None:
    """inf2 on a build host without Neuron packages: 0.8's mapping (a Mistral on the Llama
    application, its Q/K/V fused), and the review says which platform and release, and why."""
    folder = tmp_path / "Mistral-7B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MISTRAL_7B), encoding="utf-8")
    inf2, status = dry_run(folder, "--platform", "inf2", "--tensor-parallel-degree", "8")
    assert status["neuron_modules"] == []
    assert (inf2["platform"], inf2["platform_source"]) == ("inf2", "--platform")
    assert inf2["library_version"] == "0.8.0"
    assert "inferred from platform inf2 (--platform)" in inf2["library_version_source"]
    assert inf2["application_class"].endswith("modeling_llama.NeuronLlamaForCausalLM")
    assert inf2["neuron_config_kwargs"]["fused_qkv"] is True
    assert (inf2["dtype"], inf2["neuron_config_kwargs"]["torch_dtype"]) == ("bf16", "torch.bfloat16")
    trn2, _ = dry_run(folder, "--platform", "trn2", "--tensor-parallel-degree", "8")
    assert trn2["library_version"] == "0.9.0" and trn2["neuron_config_kwargs"]["fused_qkv"] is False
    assert trn2["application_class"].endswith("modeling_mistral.NeuronMistralForCausalLM")
    assert trn2["cache_key"] != inf2["cache_key"]

    given, _ = dry_run(folder, "--platform", "trn2", "--nxdi-version", "0.8", "--tensor-parallel-degree", "8")
    assert (given["library_version"], given["library_version_source"]) == ("0.8", "--nxdi-version")
    assert given["application_class"].endswith("NeuronLlamaForCausalLM")

    props = tmp_path / "serving.properties"
    props.write_text("option.neuron_platform=trn1\n", encoding="utf-8")
    keyed, _ = dry_run(folder, "--properties", str(props), "--tensor-parallel-degree", "8")
    assert (keyed["platform"], keyed["platform_source"]) == ("trn1", "option.neuron_platform")
    assert keyed["library_version"] == "0.8.0"

    text = cli("compile", "--target", "neuron", "--dry-run", "--model", str(folder), "--platform", "inf2")
    assert text.returncode == 0, text.stderr
    assert "platform             inf2 (--platform)" in text.stdout
    assert "library_version      0.8.0 (not installed; inferred from platform inf2" in text.stdout


@pytest.mark.parametrize(
    ("args", "properties", "named"),
    [
        (("--platform", "inf3"), "", "--platform"),
        ((), "option.neuron_platform=inf3\n", "option.neuron_platform"),
        (("--platform", "inf2", "--nxdi-version", "0.9"), "", "option.allow_unsupported_nxdi_on_inf2_trn1"),
        (("--platform", "trn1"), "option.nxdi_profile=trn2-tuned\n", "option.nxdi_profile=trn2-tuned"),
        (("--nxdi-version", "0.7"), "", "--nxdi-version"),
    ],
)
def test_a_bad_platform_release_or_profile_is_a_cli_error_naming_the_key(
    config_only: Path, args: tuple[str, ...], properties: str, named: str
) -> None:
    props = config_only.parent / "serving.properties"
    props.write_text(properties, encoding="utf-8")
    done = cli(
        "compile", "--target", "neuron", "--dry-run", "--model", str(config_only), "--properties", str(props),
        "--tensor-parallel-degree", "24", *args,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout
    assert named in done.stderr


def test_the_allow_key_reviews_0_9_on_inf2_with_its_warning(config_only: Path) -> None:
    props = config_only.parent / "serving.properties"
    props.write_text("option.allow_unsupported_nxdi_on_inf2_trn1=true\n", encoding="utf-8")
    out, _ = dry_run(
        config_only, "--properties", str(props), "--platform", "inf2", "--nxdi-version", "0.9.0",
        "--tensor-parallel-degree", "24",
    )  # fmt: skip
    assert out["library_version"] == "0.9.0" and len(out["warnings"]) == 1
    assert "no longer supports NKI kernels on Inf2/Trn1" in out["warnings"][0]
