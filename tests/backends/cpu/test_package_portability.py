"""A compiled package on another process or host: AMX packages run in a fresh process (which must ask
Linux for AMX's tile state first), and a package that cannot be opened is a miss, never a crash."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from compile_cache import CacheMissError, CompileCache
from neuron_lmi.backends.backend import get_or_compile
from neuron_lmi.backends.cpu import compiled_decode
from neuron_lmi.backends.cpu.backend import CPU_BACKEND, frozen_plan
from neuron_lmi.models import host_isa
from tests.backends.cpu.conftest import N_POSITIONS, N_ROWS, load_tiny


def test_a_package_that_cannot_be_opened_leaves_the_engine_eager(
    tiny_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry whose manifest matches its files but whose package this torch cannot open (written
    by a foreign build, or broken before its manifest was written) is logged and skipped."""
    model = load_tiny(tiny_llama_dir)
    cache = CompileCache(tmp_path)
    inputs = compiled_decode.decode_key_inputs(model, tiny_llama_dir, N_ROWS, N_POSITIONS)
    assert inputs.isa_features == host_isa.isa_features()
    foreign = cache.get_or_compile(
        inputs, lambda out: (out / compiled_decode.PACKAGE_FILE).write_bytes(b"PK\x03\x04 not a package")
    )
    plan = frozen_plan(model, tiny_llama_dir, N_ROWS, N_POSITIONS)
    plan = dataclasses.replace(plan, units=plan.units[:1])  # the step package alone
    assert plan.units[0].inputs == inputs
    with caplog.at_level(logging.ERROR):
        runner = CPU_BACKEND.load(plan, get_or_compile(CPU_BACKEND, plan, cache, no_compile=True))
    assert runner.compiled_decode is None
    assert f"key={foreign.key}" in caplog.text and "failed to load" in caplog.text


def test_a_package_from_before_the_features_were_keyed_is_a_miss(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model = load_tiny(tiny_llama_dir)
    cache = CompileCache(tmp_path)
    inputs = compiled_decode.decode_key_inputs(model, tiny_llama_dir, N_ROWS, N_POSITIONS)
    older = dataclasses.replace(inputs, isa_features=None)  # its manifest names no features
    cache.get_or_compile(older, lambda out: (out / compiled_decode.PACKAGE_FILE).write_bytes(b"old"))
    with pytest.raises(CacheMissError):
        plan = frozen_plan(model, tiny_llama_dir, N_ROWS, N_POSITIONS)
        get_or_compile(CPU_BACKEND, plan, cache, no_compile=True)


@pytest.mark.skipif(
    "amx_tile" not in host_isa.host_capabilities(),
    reason="this host has no AMX (amx_tile): nothing to ask for",
)
def test_an_amx_package_compiled_in_one_process_runs_in_a_fresh_one(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """bf16's autotuned step graph picks Inductor's AMX micro-GEMMs on these hosts; the warm compile
    only loads the package and must ask for AMX itself (it died with SIGILL, rc 132, before)."""
    argv = [
        sys.executable, "-m", "neuron_lmi.cli", "compile", "--model", str(tiny_llama_dir), "--target", "cpu",
        "--dtype", "bf16", "--n-positions", str(N_POSITIONS), "--max-rolling-batch-size", str(N_ROWS),
        "--cache-dir", str(tmp_path), "--json",
    ]  # fmt: skip
    cold = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
    assert cold.returncode == 0, cold.stderr
    assert json.loads(cold.stdout)["compiled"] is True
    warm = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, f"rc {warm.returncode}: {warm.stderr[-2000:]}"
    assert json.loads(warm.stdout)["compiled"] is False
