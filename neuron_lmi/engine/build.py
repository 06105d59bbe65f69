"""Assemble an ``EngineCore`` on the CPU runner from a model name, directory or GGUF file."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.scheduler import JoinPolicy

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
DEFAULT_MAX_N_POSITIONS = 2048


@dataclass(frozen=True, slots=True)
class CpuEngineOptions:
    """What the CPU engine is built from; LMI names in comments."""

    model: str = "smollm2"  # option.model_id
    dtype: str = "fp32"  # option.dtype
    max_rolling_batch_size: int = 32  # option.max_rolling_batch_size
    n_positions: int | None = None  # option.n_positions (default: min(max_position_embeddings, 2048))
    max_prefill_tokens: int = 4096
    tensor_parallel_degree: int = 1  # option.tensor_parallel_degree (logical ranks on CPU)
    group_query_attention: str | None = None  # option.group_query_attention
    num_threads: int | None = None
    # Ahead-of-time compiled graphs (neuron-lmi compile --target cpu): load from the compile cache,
    # compiling on a miss unless no_compile. compiled_graph_path (option.compiled_graph_path) is the
    # store's folder or an s3:// remote and implies compiled.
    compiled: bool = False
    compiled_graph_path: str | None = None
    no_compile: bool = False
    context_length_estimate: tuple[int, ...] | None = None  # option.context_length_estimate

    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not supported by the CPU engine (use fp32 or bf16)")
        return DTYPES[self.dtype]


def eos_ids_for(config: Any, tokenizer: Any) -> list[int]:
    eos = getattr(config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list | tuple) else [eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def build_cpu_engine_core(
    options: CpuEngineOptions, policy: JoinPolicy | None = None
) -> tuple[EngineCore, Any]:
    """Load weights and tokenizer, build the model and its runner; returns (core, config)."""
    from neuron_lmi.models import build_model
    from neuron_lmi.models.loader import load_checkpoint, load_tokenizer, resolve_model_path
    from neuron_lmi.runners.cpu import CpuRunner

    if options.max_rolling_batch_size <= 0:
        raise ValueError(f"max_rolling_batch_size must be positive, got {options.max_rolling_batch_size}")
    if options.num_threads:
        torch.set_num_threads(options.num_threads)
    dtype = options.torch_dtype()
    path = resolve_model_path(options.model)
    ckpt = load_checkpoint(path, dtype=dtype)
    max_pos = int(getattr(ckpt.config, "max_position_embeddings", DEFAULT_MAX_N_POSITIONS))
    n_positions = options.n_positions or min(max_pos, DEFAULT_MAX_N_POSITIONS)
    if n_positions <= 1:
        raise ValueError(f"n_positions must be at least 2, got {n_positions}")
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=n_positions, dtype=dtype)
    if options.tensor_parallel_degree > 1:
        from neuron_lmi.parallel.tp_model import apply_tensor_parallel

        model = apply_tensor_parallel(
            model,
            options.tensor_parallel_degree,
            options.group_query_attention or "shard-over-heads",
            batch_size=options.max_rolling_batch_size,
        )
    tokenizer = load_tokenizer(ckpt)
    if options.compiled or options.compiled_graph_path:
        from neuron_lmi.runners.compiled import compiled_runner_for_engine

        runner = compiled_runner_for_engine(
            model, path, options.max_rolling_batch_size, n_positions, options.dtype,
            context_length_estimate=options.context_length_estimate,
            compiled_graph_path=options.compiled_graph_path, no_compile=options.no_compile,
        )  # fmt: skip
    else:
        runner = CpuRunner(model, options.max_rolling_batch_size, n_positions)
    log.info(
        "CPU engine: %s (%s), %d rows x %d positions, dtype %s, KV cache %.1f MiB",
        ckpt.source,
        ckpt.config.architectures[0],
        options.max_rolling_batch_size,
        n_positions,
        options.dtype,
        runner.cache.nbytes() / 2**20,
    )
    core = EngineCore(
        runner, tokenizer, eos_ids_for(ckpt.config, tokenizer), options.max_prefill_tokens, policy
    )
    return core, ckpt.config
