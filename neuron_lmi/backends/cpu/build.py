"""Backend ``cpu``: the torch reference engine (also the AOT-compiled CPU runner with
``option.compiled_graph_path``)."""

from __future__ import annotations

from typing import Any

from neuron_lmi.backends import registry
from neuron_lmi.backends.common import DEFAULT_PREFILL_TOKENS, fetch, model_name


def build_cpu_engine(request: registry.BuildRequest) -> Any:
    """The model is fetched first (built-in, local, s3://, Hub); unless a dtype was given, bf16 on
    CPUs with native bf16 matmuls and fp32 elsewhere (``engine.default_cpu_dtype``). Decode and
    prefill run compiled graphs (``compiled_decode``, ``compiled_extend``) unless ``option.enforce_eager``."""
    from neuron_lmi.backends.cpu.engine import resolve_cpu_dtype
    from neuron_lmi.engine.process_engine import ProcessEngine

    resolved = request.resolved
    cfg = resolved.config
    path = fetch(resolved, request.env)
    dtype = resolve_cpu_dtype(None if resolved.source_of("dtype").startswith("default") else cfg.model.dtype)
    engine = ProcessEngine.from_options(
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
        quantize=cfg.neuron.quantize,  # option.quantize: int8/int4 weight-only on CPU
        # Decode and extend graphs compiled once into the compile cache, unless option.enforce_eager.
        compile_graphs=not cfg.model.enforce_eager,
    )
    engine.model_name = model_name(resolved)
    engine.dtype = dtype  # what /describe reports as model_dtype
    return engine


registry.register("cpu", build_cpu_engine)
