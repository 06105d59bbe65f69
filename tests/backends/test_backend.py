"""The one path below the configuration (``backends.backend``): plan -> compile on a miss -> load,
resolved above the runner."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import neuron_lmi
from neuron_lmi.backends.backend import get_or_compile, load_runner
from neuron_lmi.backends.cpu.backend import CPU_BACKEND
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.backends.registry import BuildRequest

PACKAGE = Path(neuron_lmi.__file__).parent
RUNNER_MODULES = ("cpu/runner.py", "cpu/aot_runner.py", "nxdi/runner.py", "tnx/runner.py")
COMPILERS = {
    "get_or_compile", "compile_cpu_entry", "compile_package", "compile_decode_package",
    "compile_extend_package", "compile_neuron_entry", "CompileCache", "cache_for", "open_store",
}  # fmt: skip


@pytest.mark.parametrize("module", RUNNER_MODULES)
def test_no_runner_calls_a_compiler(module: str) -> None:
    tree = ast.parse((PACKAGE / "backends" / module).read_text(encoding="utf-8"))
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names
    }
    assert not names & COMPILERS, f"{module} uses {sorted(names & COMPILERS)}"


def test_the_compile_command_has_no_per_backend_branch() -> None:
    source = (PACKAGE / "commands" / "compile.py").read_text(encoding="utf-8")
    for backend_module in ("backends.cpu", "backends.nxdi", "backends.tnx"):
        assert backend_module not in source


def test_an_eager_plan_has_no_units_and_needs_no_store(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from neuron_lmi.backends.cpu.engine import CpuEngineOptions
    from neuron_lmi.config import load_config

    resolved = load_config({"model_id": str(tiny_llama_dir), "dtype": "fp32", "enforce_eager": True}, env={})
    options = CpuEngineOptions.from_resolved(resolved, tiny_llama_dir, tp_degree=1)
    plan = CPU_BACKEND.plan_for(options)
    assert (plan.graphs, plan.units) == ("eager", ())
    assert get_or_compile(CPU_BACKEND, plan, None).entries == {}
    runner = load_runner(CPU_BACKEND, plan, None)
    assert isinstance(runner, CpuRunner) and runner.compiled_decode is None
    assert not runner.capabilities.mixed_steps  # fixed at construction: no step graph given


def test_the_cpu_target_plan_refuses_what_it_cannot_compile(tiny_llama_dir: Path) -> None:
    from neuron_lmi.backends.backend import CompileOptions
    from neuron_lmi.config import load_config

    resolved = load_config({"model_id": str(tiny_llama_dir), "quantize": "int8"}, env={})
    with pytest.raises(ValueError, match="--quantize: the bucket graphs take dense weights"):
        CPU_BACKEND.plan(
            BuildRequest(resolved, {}, "cpu", 1), tiny_llama_dir, CompileOptions("compile", "buckets")
        )
    with pytest.raises(ValueError, match="--tensor-parallel-degree"):
        CPU_BACKEND.plan(BuildRequest(resolved, {}, "cpu", 2), tiny_llama_dir, CompileOptions("compile"))


def _project_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    found |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return {name for name in found if name.startswith("neuron_lmi.")}


@pytest.mark.parametrize("layer", ["models", "parallel", "runners", "config", "engine"])
def test_a_layer_below_the_backends_imports_none(layer: str) -> None:
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        upward = {name for name in _project_imports(path) if name.startswith("neuron_lmi.backends")}
        assert not upward, f"{path.relative_to(PACKAGE)} imports {sorted(upward)}"


@pytest.mark.parametrize("backend", ["cpu", "nxdi", "tnx"])
def test_a_backend_folder_imports_no_other_backend_folder(backend: str) -> None:
    others = {f"neuron_lmi.backends.{name}" for name in ("cpu", "nxdi", "tnx") if name != backend}
    for path in sorted((PACKAGE / "backends" / backend).rglob("*.py")):
        sideways = {n for n in _project_imports(path) if any(n == o or n.startswith(o + ".") for o in others)}
        assert not sideways, f"backends/{backend}/{path.name} imports {sorted(sideways)}"


def test_the_transformers_neuronx_rules_live_in_its_backend() -> None:
    assert not (PACKAGE / "parallel" / "tnx_rules.py").exists()
    assert not (PACKAGE / "parallel" / "planner.py").exists()
    for path in sorted((PACKAGE / "parallel").rglob("*.py")):
        assert "continuous_batching" not in path.read_text(encoding="utf-8"), path.name
