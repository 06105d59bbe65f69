"""What the backends share: fetching the model, LMI's model defaults, the compile cache that
``option.compiled_graph_path`` names, end-of-sequence ids, and wrapping a runner in an engine.

``rolling_batch_engine`` is the one place a ``ModelRunner`` (transformers-neuronx's, NxD Inference's)
becomes an ``Engine``: tokenizer, end-of-sequence ids, ``EngineCore``, ``AsyncEngine``. The CPU
backend builds its own core in the engine process (``backends.cpu.engine``) but takes the same ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from compile_cache import CompileCache, open_store
from neuron_lmi.config import apply_model_defaults
from neuron_lmi.config.hf_config import max_position_embeddings, read_hf_config
from neuron_lmi.config.options import DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MODEL
from neuron_lmi.engine.async_engine import AsyncEngine
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.model_source import fetch_model, model_cache_dir

if TYPE_CHECKING:
    from neuron_lmi.config import ResolvedConfig


def model_name(resolved: ResolvedConfig) -> str:
    return resolved.config.model.model_id or DEFAULT_MODEL


def fetch(resolved: ResolvedConfig, env: Mapping[str, str]) -> Path:
    """The model as a local directory or file (built-in, local, ``s3://``, Hub), within
    ``option.model_loading_timeout``."""
    model = resolved.config.model
    return fetch_model(
        model_name(resolved), model_cache_dir(env), model.model_loading_timeout, env, revision=model.revision
    )


def read_config_json(path: str | Path) -> dict[str, Any]:

    return read_hf_config(path, "the Neuron backends")


def with_model_defaults(resolved: ResolvedConfig, path: str | Path) -> ResolvedConfig:
    """``n_positions`` from LMI's smart default, ``min(max_position_embeddings, 4096)``, when no
    source set it (a fetched model is read only now). Where a source set it, ``config.json`` is not
    read: a backend's ``engine`` resolves once and its ``plan`` calls this again on the result."""
    if resolved.config.batching.n_positions is not None:
        return resolved
    return apply_model_defaults(resolved, max_position_embeddings(read_config_json(path)))


def cache_for(compiled_graph_path: str | None, cache_dir: str | Path | None = None) -> CompileCache:
    """LMI's ``option.compiled_graph_path``: an ``s3://`` URI is the remote (local root as usual),
    anything else the local store's root; ``cache_dir`` (``--cache-dir``) is the local root as given.

    A root that cannot be written (SageMaker's read-only ``/opt/ml/model/compiled``) is read in place
    as a seed, and misses, damaged entries and locks go to a writable store (``open_store``)."""
    remote = compiled_graph_path if compiled_graph_path and compiled_graph_path.startswith("s3://") else None
    if cache_dir is not None:
        return CompileCache(cache_dir, remote=remote)
    return open_store(None if remote else compiled_graph_path or None, remote=remote)


def neuron_compile_cache(resolved: ResolvedConfig) -> CompileCache:
    """The store ``neuron-lmi compile`` fills for the same ``option.compiled_graph_path``."""
    return cache_for(resolved.config.neuron.compiled_graph_path)


def eos_ids_for(config: Any, tokenizer: Any) -> list[int]:
    """The model config's ``eos_token_id`` (one id or a list) and the tokenizer's, sorted: either
    one ends a request (a chat model's config often names only the end-of-turn token)."""
    eos = getattr(config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list | tuple) else [eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def rolling_batch_engine(
    runner: Any, path: str | Path, resolved: ResolvedConfig, backend: str, model_dtype: str | None = None
) -> AsyncEngine:
    """Our rolling-batch engine (scheduler, host sampler, stop checks) around ``runner``;
    ``model_dtype`` is what ``/info`` reports (the runner's, where it says; else ``option.dtype``)."""
    from transformers import AutoTokenizer

    cfg = resolved.config
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    config = SimpleNamespace(eos_token_id=read_config_json(path).get("eos_token_id"))
    core = EngineCore(
        runner,
        tokenizer,
        eos_ids_for(config, tokenizer),
        cfg.batching.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS,
        # Refused at start-up, naming the key, where the runner cannot verify drafts.
        speculative=cfg.batching.speculation,
    )
    return AsyncEngine(
        core,
        model_name=model_name(resolved),
        max_queue_size=cfg.batching.max_queue_size,
        backend_name=backend,
        model_dtype=model_dtype,
    )
