"""Backend ``neuron-nxdi``: NxD Inference behind our rolling-batch engine. Artifacts come from
``option.compiled_graph_path`` when it is an artifact directory (``neuron_config.json`` +
``model.pt``), else from the compile cache, compiled into it once on a miss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuron_lmi.backends import registry
from neuron_lmi.backends.builders.common import (
    fetch,
    neuron_compile_cache,
    rolling_batch_engine,
    with_model_defaults,
)


def build_nxdi_engine(request: registry.BuildRequest) -> Any:
    from neuron_lmi.backends.nxdi.artifacts import is_artifact_dir
    from neuron_lmi.backends.nxdi.runner import build_nxdi_runner

    path = fetch(request.resolved, request.env)
    resolved = with_model_defaults(request.resolved, path)
    given = resolved.config.neuron.compiled_graph_path
    # An artifact directory is loaded as it is: no store is opened over it.
    cache = None if given and is_artifact_dir(Path(given)) else neuron_compile_cache(resolved)
    runner = build_nxdi_runner(resolved.config, str(path), cache, tp_degree=request.tp_degree)
    return rolling_batch_engine(runner, path, resolved, "neuron-nxdi")


registry.register("neuron-nxdi", build_nxdi_engine)
