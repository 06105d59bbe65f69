"""Backend ``neuron-tnx``: transformers-neuronx (Neuron SDK <= 2.25) behind our rolling-batch engine;
NEFFs through the compile cache (``neuron-lmi compile --target neuron`` fills the same entries)."""

from __future__ import annotations

from typing import Any

from neuron_lmi.backends import registry
from neuron_lmi.backends.common import (
    fetch,
    neuron_compile_cache,
    rolling_batch_engine,
    with_model_defaults,
)
from neuron_lmi.backends.tnx.runner import build_neuron_runner


def build_tnx_engine(request: registry.BuildRequest) -> Any:

    path = fetch(request.resolved, request.env)
    resolved = with_model_defaults(request.resolved, path)
    cache = neuron_compile_cache(resolved)
    runner = build_neuron_runner(resolved.config, str(path), cache, tp_degree=request.tp_degree)
    return rolling_batch_engine(runner, path, resolved, "neuron-tnx")


registry.register("neuron-tnx", build_tnx_engine)
