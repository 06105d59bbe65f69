"""Shared fixtures: tiny random checkpoints (built once per session) and the SmolLM2 GGUF; and
``cpu_options``, the CPU engine's options from configuration keys."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from neuron_lmi.testing.checkpoints import make_tiny_checkpoint

if TYPE_CHECKING:
    from neuron_lmi.backends.cpu.engine import CpuEngineOptions


def cpu_options(model: str | Path, **keys: object) -> CpuEngineOptions:
    """The CPU engine's options as ``serve`` resolves them from ``keys`` (LMI's names; no
    serving.properties, no environment) for ``model`` as given, with what the parity tests need said
    as configuration: ``dtype=fp32`` and ``enforce_eager=true`` unless ``keys`` say otherwise."""
    # Imported here: every test session loads this file, and most never need torch.
    from neuron_lmi.backends.cpu.engine import CpuEngineOptions
    from neuron_lmi.config import load_config

    resolved = load_config({"model_id": str(model), "dtype": "fp32", "enforce_eager": True, **keys}, None, {})
    degree = resolved.config.parallel.tensor_parallel_degree
    return CpuEngineOptions.from_resolved(resolved, model, 1 if degree == "max" else int(degree))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with GQA (4 query / 2 KV heads), untied embeddings, one safetensors file."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture()
def tiny_llama_properties(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    """A serving.properties for the tiny Llama: 3 rows, fp32, eager (``LLM`` and ``generate`` read it
    as ``serve`` does)."""
    path = tmp_path / "serving.properties"
    keys = [f"option.model_id={tiny_llama_dir}", "option.max_rolling_batch_size=3", "option.dtype=fp32"]
    path.write_text("\n".join([*keys, "option.enforce_eager=true", ""]))
    return path


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Mistral with a 16-token sliding window, saved as sharded safetensors with an index."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=1, safe_serialization_max_shard="2MB"
    )


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from neuron_lmi.models.builtin import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture()
def copy_dir(tmp_path: Path):
    def _copy(src: Path, name: str = "copy") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return _copy
