"""One real AOTInductor compile of a tiny model per session, shared by the tests that only read it.

The entry is compiled for 4 rows x 128 positions (buckets: prefill 64, decode 128: two graphs), the
same plan the engine derives for ``max_rolling_batch_size=4, n_positions=128``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

N_ROWS, N_POSITIONS = 4, 128


@dataclass
class CompiledStore:
    """The session's store: its root, the tiny checkpoint, and which graphs the first open compiled."""

    root: Path
    model_dir: Path
    key: str
    compiled_graphs: list[tuple[str, int]]
    n_rows: int = N_ROWS
    n_positions: int = N_POSITIONS

    def load_model(self):
        return load_tiny(self.model_dir)

    def plan(self, n_rows: int = N_ROWS):
        from neuron_lmi.backends.cpu.aot import CpuPlan

        return CpuPlan.default(n_rows, N_POSITIONS, "fp32")


def load_tiny(model_dir: Path, dtype: torch.dtype = torch.float32):
    from neuron_lmi.models import build_model
    from neuron_lmi.models.loader import load_checkpoint

    ckpt = load_checkpoint(model_dir, dtype=dtype)
    return build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS, dtype=dtype)


@pytest.fixture(scope="module")
def model(tiny_llama_dir: Path):
    """The tiny Llama as the engine loads it (fp32, eager, 256 positions): the runner tests' model."""
    from neuron_lmi.backends.cpu.llm import LLM

    return LLM(
        str(tiny_llama_dir), dtype="fp32", enforce_eager=True, max_rolling_batch_size=1, n_positions=256
    ).core.runner.model


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def counting(calls: list[tuple[str, int]], real: Callable[..., None]) -> Callable[..., None]:
    """Wrap ``aot.compile_graph`` so a test can assert which graphs were compiled."""

    def wrapper(model, plan, kind: str, size: int, path: Path) -> None:
        calls.append((kind, size))
        real(model, plan, kind, size, path)

    return wrapper


@pytest.fixture(scope="session")
def compiled_store(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> CompiledStore:
    from compile_cache import CompileCache
    from neuron_lmi.backends.backend import get_or_compile
    from neuron_lmi.backends.cpu import aot
    from neuron_lmi.backends.cpu.backend import CPU_BACKEND, bucket_plan

    root = tmp_path_factory.mktemp("compile_store")
    calls: list[tuple[str, int]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aot, "compile_graph", counting(calls, aot.compile_graph))
        plan = bucket_plan(
            load_tiny(tiny_llama_dir), tiny_llama_dir, aot.CpuPlan.default(N_ROWS, N_POSITIONS, "fp32")
        )
        artifacts = get_or_compile(CPU_BACKEND, plan, CompileCache(root))
    assert artifacts.compiled == {"buckets"}
    return CompiledStore(root, tiny_llama_dir, artifacts.entry("buckets").key, calls)


@pytest.fixture()
def compile_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Records every real graph compile made during the test as ``(kind, size)``."""
    from neuron_lmi.backends.cpu import aot

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(aot, "compile_graph", counting(calls, aot.compile_graph))
    return calls
