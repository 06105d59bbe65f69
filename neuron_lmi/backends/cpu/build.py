"""Backend ``cpu``: the torch reference engine (also the AOT-compiled CPU runner with
``option.compiled_graph_path``), in its own process."""

from __future__ import annotations

from typing import Any

from neuron_lmi.backends import registry
from neuron_lmi.backends.common import fetch, model_name
from neuron_lmi.backends.cpu import engine as cpu


def build_cpu_engine(request: registry.BuildRequest) -> Any:
    """The model is fetched first (built-in, local, s3://, Hub); the engine process then builds the
    core from the configuration's CPU view (``engine.CpuEngineOptions.from_resolved``)."""
    path = fetch(request.resolved, request.env)
    options = cpu.CpuEngineOptions.from_resolved(request.resolved, path, request.tp_degree)
    return cpu.cpu_process_engine(options, model_name=model_name(request.resolved))


registry.register("cpu", build_cpu_engine)
