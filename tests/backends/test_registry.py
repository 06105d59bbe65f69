"""The engine builder registry and ``serve``'s path through it: configuration -> backend name ->
builder -> Engine, with no backend importing the command line."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends import dispatch, registry
from neuron_lmi.backends.dispatch import BackendProbe
from neuron_lmi.backends.tnx.runner import NeuronRunner
from neuron_lmi.config import load_config
from neuron_lmi.testing.tnx_contract import ContractModel

N_ROWS, N_POSITIONS = 4, 64


def test_every_builtin_backend_resolves_to_its_builder() -> None:
    expected = {
        "cpu": "CpuBackend.engine",
        "neuron-tnx": "TnxBackend.engine",
        "neuron-nxdi": "NxdiBackend.engine",
        "vllm": "build_vllm_engine",
        "vllm-neuron": "build_vllm_neuron_engine",
    }
    assert set(registry.BUILTIN_MODULES) == set(dispatch.BACKEND_NAMES) == set(expected)
    for name, function in expected.items():
        assert registry.get(name).__qualname__ == function
    assert set(expected) <= set(registry.registered())


def test_a_backend_folder_is_one_object_with_the_compile_path() -> None:
    for name in ("cpu", "neuron-tnx", "neuron-nxdi"):
        backend = registry.backend(name)
        assert backend.name == name and registry.get(name) == backend.engine
        assert all(callable(getattr(backend, step)) for step in ("plan", "compile", "load"))
    with pytest.raises(LookupError, match="'vllm' has nothing to compile"):
        registry.backend("vllm")


def test_unknown_backend_and_conflicting_registration() -> None:
    with pytest.raises(LookupError, match=r"'tpu'.*known: cpu"):
        registry.get("tpu")
    builder = registry.get("cpu")
    registry.register("cpu", builder)  # the same builder again (a module imported twice): fine

    def build_cpu_engine_elsewhere(request: registry.BuildRequest) -> Any:
        return None

    with pytest.raises(ValueError, match=r"already built by CpuBackend\.engine"):
        registry.register("cpu", build_cpu_engine_elsewhere)
    assert registry.get("cpu") is builder


def test_no_backend_imports_the_command_line() -> None:
    code = (
        "import sys\n"
        "from neuron_lmi.backends import registry\n"
        "for name in registry.BUILTIN_MODULES: registry.get(name)\n"
        "bad = sorted(m for m in sys.modules if m.startswith('neuron_lmi.commands') or m == 'vllm' "
        "or m.startswith(('vllm.', 'neuronx_distributed_inference', 'transformers_neuronx')))\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# -- serve: configuration -> backend name -> builder ---------------------------------------------


@pytest.fixture()
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[registry.BuildRequest]:
    """Every backend's builder replaced by one that records its request."""
    requests: list[registry.BuildRequest] = []
    for name in registry.BUILTIN_MODULES:
        registry.get(name)
        monkeypatch.setitem(registry._BUILDERS, name, lambda request: requests.append(request) or "engine")
    return requests


def _properties(tmp_path: Path, model: Path, **options: str) -> Path:
    path = tmp_path / "serving.properties"
    lines = {"option.model_id": str(model), **{f"option.{k}": v for k, v in options.items()}}
    path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
    return path


def _build(monkeypatch, probe: BackendProbe, props: Path, env: dict[str, str] | None = None) -> Any:
    from neuron_lmi.commands.serve import build_engine

    monkeypatch.setattr(dispatch, "probe_host", lambda requested, env=None, **_: probe)
    return build_engine(load_config(properties_path=props, env={}), env or {})


INF2_48 = BackendProbe(neuron_devices=12, nxdi_version="0.9.0", tnx_version="0.13.0")


@pytest.mark.parametrize(
    ("options", "probe", "backend", "tp"),
    [
        ({"tensor_parallel_degree": "max"}, INF2_48, "neuron-nxdi", 24),
        ({"tensor_parallel_degree": "max", "model_loader": "tnx"}, INF2_48, "neuron-tnx", 24),
        ({"tensor_parallel_degree": "8", "rolling_batch": "tnx"}, INF2_48, "neuron-nxdi", 8),
        (
            {"rolling_batch": "vllm", "tensor_parallel_degree": "max"},
            BackendProbe(
                neuron_devices=16, nxdi_version="0.9", vllm_neuron_version="0.2.0", vllm_importable=True
            ),
            "vllm-neuron",
            32,
        ),
        ({"tensor_parallel_degree": "max"}, BackendProbe(cuda_devices=4, vllm_importable=True), "vllm", 4),
        ({"tensor_parallel_degree": "max"}, BackendProbe(), "cpu", 1),
    ],
)
def test_build_engine_routes_through_the_registry(
    recorded, monkeypatch, tmp_path, tiny_llama_dir, caplog, options, probe, backend, tp
) -> None:
    with caplog.at_level(logging.INFO, logger="neuron_lmi.commands.serve"):
        assert _build(monkeypatch, probe, _properties(tmp_path, tiny_llama_dir, **options)) == "engine"
    (request,) = recorded
    assert (request.backend, request.tp_degree) == (backend, tp)
    assert request.choice is not None and request.choice.name == backend
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("backend "))
    assert f"backend {backend}" in line and f"tensor parallel degree {tp}" in line
    if request.choice.version:  # which library, which version, and why
        assert f"{request.choice.library} {request.choice.version}" in line


def test_build_engine_fails_at_start_up_on_a_neuron_host_without_a_library(
    recorded, monkeypatch, tmp_path, tiny_llama_dir
) -> None:
    with pytest.raises(dispatch.BackendUnavailableError, match="transformers-neuronx"):
        _build(monkeypatch, BackendProbe(neuron_devices=1), _properties(tmp_path, tiny_llama_dir))
    assert recorded == []


# -- the Neuron builders share one runner-to-engine wrapping -------------------------------------


@pytest.mark.parametrize(
    ("backend", "module", "function"),
    [
        ("neuron-tnx", "neuron_lmi.backends.tnx.backend", "build_neuron_runner"),
        ("neuron-nxdi", "neuron_lmi.backends.nxdi.backend", "build_nxdi_runner"),
    ],
)
def test_neuron_builders_wrap_the_runner_in_the_rolling_batch_engine(
    monkeypatch, tmp_path, tiny_llama_dir, backend, module, function
) -> None:
    import importlib

    from neuron_lmi.models import build_model
    from neuron_lmi.models.loader import load_checkpoint

    ckpt = load_checkpoint(tiny_llama_dir, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    calls: list[tuple[Any, ...]] = []

    def fake_runner(request, model_path, **_):
        calls.append((request, model_path))
        contract = ContractModel(model, N_ROWS, N_POSITIONS)
        runner = NeuronRunner(contract, N_ROWS, N_POSITIONS, model.args.vocab_size, contract.context_buckets)
        runner.dtype = "bf16"  # an NxdiRunner says what its application computes in
        return runner

    monkeypatch.setattr(importlib.import_module(module), function, fake_runner)
    props = _properties(tmp_path, tiny_llama_dir, max_rolling_batch_size=str(N_ROWS))
    resolved = load_config(properties_path=props, env={"NEURON_LMI_CACHE_DIR": str(tmp_path / "cache")})
    request = registry.BuildRequest(resolved, {}, backend, 2)
    engine = registry.get(backend)(request)

    (got, model_path) = calls[0]
    assert (str(model_path), got.tp_degree, got.backend) == (str(tiny_llama_dir), 2, backend)
    assert (engine.backend_name, engine.model_name) == (backend, str(tiny_llama_dir))
    assert (engine.max_batch_size, engine.n_positions) == (N_ROWS, N_POSITIONS)
    assert engine.max_queue_size == resolved.config.batching.max_queue_size
    assert engine.core.eos_token_ids  # read from config.json / the tokenizer
    assert engine.model_dtype == ("bf16" if backend == "neuron-nxdi" else None)


def test_one_table_of_backend_requests_feeds_config_cli_and_dispatch() -> None:
    import typing

    from neuron_lmi.config.options import BACKEND_REQUESTS, ROLLING_BATCH_REQUESTS, Backend, RollingBatch

    assert (
        typing.get_args(RollingBatch)
        == tuple(ROLLING_BATCH_REQUESTS)
        == tuple(dispatch.ROLLING_BATCH_TO_BACKEND)
    )
    assert typing.get_args(Backend) == BACKEND_REQUESTS == dispatch.REQUESTS
    for alias in ROLLING_BATCH_REQUESTS:  # every value the configuration takes, dispatch resolves
        assert dispatch.requested_from_lmi(None, alias) in BACKEND_REQUESTS
    assert dispatch.requested_from_lmi(None, "lmi-dist") == "vllm"
