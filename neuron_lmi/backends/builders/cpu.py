"""Backend ``cpu``: the torch reference engine (also the AOT-compiled CPU runner with
``option.compiled_graph_path``)."""

from __future__ import annotations

from typing import Any

from neuron_lmi.backends import registry
from neuron_lmi.backends.builders.common import DEFAULT_PREFILL_TOKENS, fetch, model_name


def build_cpu_engine(request: registry.BuildRequest) -> Any:
    """The model is fetched first (built-in, local, s3://, Hub); fp32 unless a dtype was given."""
    from neuron_lmi.engine.async_engine import AsyncEngine

    resolved = request.resolved
    cfg = resolved.config
    path = fetch(resolved, request.env)
    dtype = "fp32" if resolved.source_of("dtype").startswith("default") else cfg.model.dtype
    engine = AsyncEngine.from_options(
        str(path),
        dtype=dtype,
        max_rolling_batch_size=cfg.batching.max_rolling_batch_size,
        n_positions=cfg.batching.n_positions,
        max_queue_size=cfg.batching.max_queue_size,
        max_prefill_tokens=cfg.batching.max_prefill_tokens or DEFAULT_PREFILL_TOKENS,
        tensor_parallel_degree=request.tp_degree,
        # LMI's option.compiled_graph_path (a directory or s3:// URI) turns on the AOT-compiled runner.
        compiled_graph_path=cfg.neuron.compiled_graph_path,
        context_length_estimate=cfg.batching.context_length_estimate,
    )
    engine.model_name = model_name(resolved)
    return engine


registry.register("cpu", build_cpu_engine)
