"""Backend ``neuron-nxdi``: NxD Inference behind our rolling-batch engine. Artifacts come from
``option.compiled_graph_path`` when it is an artifact directory (``neuron_config.json`` +
``model.pt``), else from the compile cache, compiled into it once on a miss. With
``override_neuron_config.on_cpu`` the library's modeling code runs on the CPU and nothing is cached."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from neuron_lmi.backends import registry
from neuron_lmi.backends.common import (
    fetch,
    neuron_compile_cache,
    rolling_batch_engine,
    with_model_defaults,
)
from neuron_lmi.backends.host import NXDI, installed_version
from neuron_lmi.backends.nxdi.artifacts import is_artifact_dir
from neuron_lmi.backends.nxdi.runner import build_nxdi_runner
from neuron_lmi.backends.nxdi.support import target_platform


def build_nxdi_engine(request: registry.BuildRequest) -> Any:

    path = fetch(request.resolved, request.env)
    resolved = with_model_defaults(request.resolved, path)
    neuron = resolved.config.neuron
    given = neuron.compiled_graph_path
    # An artifact directory is loaded as it is, and the CPU mode compiles nothing: no store is opened.
    no_store = neuron.nxdi_on_cpu or (given and is_artifact_dir(Path(given)))
    cache = None if no_store else neuron_compile_cache(resolved)
    choice = request.choice
    version = (choice.version if choice else None) or installed_version(NXDI.distribution)
    runner = build_nxdi_runner(
        resolved.config,
        str(path),
        cache,
        tp_degree=request.tp_degree,
        library_version=version if version != "unknown version" else None,
        platform=target_platform(neuron.neuron_platform, request.env, serving=not neuron.nxdi_on_cpu),
    )
    engine = rolling_batch_engine(runner, path, resolved, "neuron-nxdi")
    # What /info reports as model_dtype (the checkpoint's when option.dtype is unset); serve falls back
    # to option.dtype for a runner that does not say.
    engine.dtype = getattr(runner, "dtype", None)
    return engine


registry.register("neuron-nxdi", build_nxdi_engine)
