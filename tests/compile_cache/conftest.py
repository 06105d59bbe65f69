"""Fixtures for the compile cache tests: key inputs and a compile function that counts its runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from compile_cache.key import CacheKeyInputs

ARCH: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "max_position_embeddings": 512,
    "rope_scaling": None,
}


def make_inputs(**overrides: Any) -> CacheKeyInputs:
    fields: dict[str, Any] = {
        "architecture": ARCH,
        "target": "cpu",
        "compiler": "torch-aotinductor",
        "compiler_version": "2.5.1",
        "n_positions": 512,
        "context_buckets": (64, 128, 256),
        "token_buckets": (128, 256, 512),
        "dtype": "bf16",
        "batch_size": 4,
        "tensor_parallel_degree": 1,
    }
    fields.update(overrides)
    return CacheKeyInputs(**fields)


class CountingCompile:
    """A compile_fn writing two artifacts (one in a subfolder) and counting how often it ran."""

    def __init__(self, payload: bytes = b"compiled-graph-bytes" * 50) -> None:
        self.calls = 0
        self.payload = payload

    def __call__(self, out: Path) -> None:
        self.calls += 1
        (out / "model.pt2").write_bytes(self.payload)
        (out / "neff").mkdir()
        (out / "neff" / "bucket_128.neff").write_bytes(b"\x00\x01" * 100)


@pytest.fixture()
def inputs() -> CacheKeyInputs:
    return make_inputs()


@pytest.fixture()
def compile_fn() -> CountingCompile:
    return CountingCompile()


@pytest.fixture()
def make_compile() -> Callable[..., CountingCompile]:
    return CountingCompile


@pytest.fixture()
def make_key_inputs() -> Callable[..., CacheKeyInputs]:
    return make_inputs
