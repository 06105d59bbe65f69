"""What the builders share: fetching the model, LMI's model defaults, and wrapping a runner in an engine.

``rolling_batch_engine`` is the one place a ``ModelRunner`` (transformers-neuronx's, NxD Inference's)
becomes an ``Engine``: tokenizer, end-of-sequence ids, ``EngineCore``, ``AsyncEngine``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from neuron_lmi.config.options import DEFAULT_MODEL

if TYPE_CHECKING:
    from compile_cache import CompileCache
    from neuron_lmi.config import ResolvedConfig
    from neuron_lmi.engine.async_engine import AsyncEngine

DEFAULT_PREFILL_TOKENS = 4096


def model_cache_dir(env: Mapping[str, str]) -> Path:
    """Where fetched models go: ``NEURON_LMI_MODEL_CACHE``, else ``~/.cache/neuron-lmi/models``."""
    return Path(env.get("NEURON_LMI_MODEL_CACHE") or Path.home() / ".cache" / "neuron-lmi" / "models")


def model_name(resolved: ResolvedConfig) -> str:
    return resolved.config.model.model_id or DEFAULT_MODEL


def fetch(resolved: ResolvedConfig, env: Mapping[str, str]) -> Path:
    """The model as a local directory or file (built-in, local, ``s3://``, Hub), within
    ``option.model_loading_timeout``."""
    from neuron_lmi.model_source import fetch_model

    model = resolved.config.model
    return fetch_model(
        model_name(resolved), model_cache_dir(env), model.model_loading_timeout, env, revision=model.revision
    )


def read_config_json(path: str | Path) -> dict[str, Any]:
    from neuron_lmi.model_source.hf_config import read_hf_config

    return read_hf_config(path, "the Neuron backends")


def with_model_defaults(resolved: ResolvedConfig, path: str | Path) -> ResolvedConfig:
    """``n_positions`` from LMI's smart default, ``min(max_position_embeddings, 4096)``, when no
    source set it (a fetched model is read only now)."""
    from neuron_lmi.config import apply_model_defaults

    value = read_config_json(path).get("max_position_embeddings")
    return apply_model_defaults(resolved, value if isinstance(value, int) and value > 0 else None)


def neuron_compile_cache(resolved: ResolvedConfig) -> CompileCache:
    """The store ``neuron-lmi compile`` fills for the same ``option.compiled_graph_path``."""
    from neuron_lmi.runners.compiled import cache_for

    return cache_for(resolved.config.neuron.compiled_graph_path)


def rolling_batch_engine(
    runner: Any, path: str | Path, resolved: ResolvedConfig, backend: str
) -> AsyncEngine:
    """Our rolling-batch engine (scheduler, host sampler, stop checks) around ``runner``."""
    from transformers import AutoTokenizer

    from neuron_lmi.engine.async_engine import AsyncEngine
    from neuron_lmi.engine.build import eos_ids_for
    from neuron_lmi.engine.core import EngineCore

    cfg = resolved.config
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    config = SimpleNamespace(eos_token_id=read_config_json(path).get("eos_token_id"))
    core = EngineCore(
        runner,
        tokenizer,
        eos_ids_for(config, tokenizer),
        cfg.batching.max_prefill_tokens or DEFAULT_PREFILL_TOKENS,
    )
    engine = AsyncEngine(core, model_name=model_name(resolved), max_queue_size=cfg.batching.max_queue_size)
    engine.backend_name = backend
    return engine
