"""Shared fixtures: tiny random checkpoints (built once per session) and the SmolLM2 GGUF."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from neuron_lmi.testing.checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with GQA (4 query / 2 KV heads), untied embeddings, one safetensors file."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


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
