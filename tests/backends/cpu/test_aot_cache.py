"""The cpu target and the compile cache: hits load without compiling, key changes and damage recompile."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from compile_cache import CacheMissError, CompileCache
from neuron_lmi.backends.backend import get_or_compile
from neuron_lmi.backends.cpu import aot
from neuron_lmi.backends.cpu.backend import CPU_BACKEND, bucket_plan
from neuron_lmi.cli import main
from tests.backends.cpu.conftest import CompiledStore

pytestmark = pytest.mark.slow


def test_first_open_compiled_every_bucket(compiled_store: CompiledStore) -> None:
    assert compiled_store.compiled_graphs == [("prefill", 64), ("decode", 128)]
    entry = CompileCache(compiled_store.root).show(compiled_store.key)
    assert entry.files == ["decode-128.pt2", "graphs.json", "prefill-64.pt2"]
    # Weights stay out of the packages: each is far smaller than the tiny model's 25 MB of weights.
    assert all(entry.manifest.files[f].size < 8 * 2**20 for f in entry.files)


def test_second_open_is_a_hit_that_compiles_nothing(
    compiled_store: CompiledStore, compile_calls: list[tuple[str, int]]
) -> None:
    s = compiled_store
    plan = bucket_plan(s.load_model(), s.model_dir, s.plan())
    artifacts = get_or_compile(CPU_BACKEND, plan, CompileCache(s.root), no_compile=True)
    CPU_BACKEND.load(plan, artifacts)  # the stored graphs bind to the model's weights
    assert (artifacts.compiled, compile_calls, artifacts.entry("buckets").key) == (set(), [], s.key)


def test_changing_one_key_input_makes_a_new_entry(compiled_store: CompiledStore, tmp_path: Path) -> None:
    root = tmp_path / "store"
    shutil.copytree(compiled_store.root, root)
    model = compiled_store.load_model()
    calls: list[tuple[str, int]] = []

    def fake_compile(model, plan, kind: str, size: int, path: Path) -> None:
        calls.append((kind, size))
        path.write_bytes(b"not a real package")

    plan = compiled_store.plan(n_rows=compiled_store.n_rows - 1)  # one input changed: the batch
    inputs = aot.cpu_key_inputs(model, compiled_store.model_dir, plan)
    cache = CompileCache(root)
    entry = cache.get_or_compile(
        inputs, lambda out: aot.compile_cpu_entry(model, plan, out, compile_one=fake_compile)
    )
    assert entry.key != compiled_store.key
    assert calls == [("prefill", 64), ("decode", 128)]
    assert sorted(e.key for e in cache.list()) == sorted([entry.key, compiled_store.key])


def test_no_compile_on_a_miss_fails_clearly(compiled_store: CompiledStore, tmp_path: Path) -> None:
    s = compiled_store
    with pytest.raises(CacheMissError, match="no_compile"):
        get_or_compile(
            CPU_BACKEND, bucket_plan(s.load_model(), s.model_dir, s.plan()), CompileCache(tmp_path), True
        )


def test_corrupt_byte_is_named_by_verify_and_recompiled(
    compiled_store: CompiledStore,
    tmp_path: Path,
    compile_calls: list[tuple[str, int]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = tmp_path / "store"
    shutil.copytree(compiled_store.root, root)
    cache = CompileCache(root)
    artifact = cache.resolve(compiled_store.key) / "decode-128.pt2"
    data = bytearray(artifact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artifact.write_bytes(bytes(data))

    assert main(["cache", "verify", "--cache-dir", str(root)]) == 1
    assert "decode-128.pt2" in capsys.readouterr().out

    s = compiled_store
    artifacts = get_or_compile(CPU_BACKEND, bucket_plan(s.load_model(), s.model_dir, s.plan()), cache)
    assert artifacts.compiled == {"buckets"} and compile_calls == [("prefill", 64), ("decode", 128)]
    assert cache.verify(compiled_store.key).ok
    assert any(
        p.name.startswith(f"{compiled_store.key}.corrupt-")
        for p in artifacts.entry("buckets").path.parent.iterdir()
    )


def test_plan_validation() -> None:
    with pytest.raises(ValueError, match="n_positions"):
        aot.CpuPlan(4, 128, "fp32", (256,), (128,))
    with pytest.raises(ValueError, match="n_rows"):
        aot.CpuPlan(0, 128, "fp32", (64,), (128,))
    assert aot.CpuPlan.default(8, 512, "fp32", (100, 300)).graphs() == [
        ("prefill", 100),
        ("prefill", 300),
        ("decode", 128),
        ("decode", 256),
        ("decode", 512),
    ]
