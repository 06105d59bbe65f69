"""The vLLM backends' engine builders, registered as ``vllm`` (CUDA, or a CPU build of vLLM when asked
for) and ``vllm-neuron`` (vLLM with the vllm-neuron platform plugin; see ``neuron_platform.py``).

Both build the same ``VllmEngine`` from the server's resolved configuration alone
(``gpu_fallback.config.vllm_config_from_resolved``: the shared fields, vLLM's own section, and the
engine arguments the loader kept in ``vllm_options``). Importing this module imports no vLLM.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from compile_cache import writable_cache_root
from gpu_fallback.config import VllmEngineConfig, vllm_config_from_resolved
from gpu_fallback.engine import VllmEngine
from gpu_fallback.neuron_platform import neuron_platform_setup
from neuron_lmi.backends import registry
from neuron_lmi.backends.common import fetch, model_name, read_config_json, with_model_defaults
from neuron_lmi.backends.lora import resolve_lora
from neuron_lmi.config import ResolvedConfig

log = logging.getLogger(__name__)


def vllm_engine_config(
    resolved: ResolvedConfig,
    path: Path,
    tp_degree: int,
    env: Mapping[str, str],
    gpu_defaults: bool = True,
) -> VllmEngineConfig:
    """The engine configuration shared by both vLLM backends; ``tp_degree`` is already resolved.
    ``gpu_defaults``: LMI-on-vLLM defaults for what no source set (see ``vllm_config_from_resolved``).
    The start-up LoRA adapters are resolved and fetched here, as for the CPU engine."""
    lora = resolve_lora(resolved, path, env)
    name = model_name(resolved)
    return vllm_config_from_resolved(resolved, str(path), name, tp_degree, gpu_defaults, lora=lora)


def build_vllm_engine(request: registry.BuildRequest) -> VllmEngine:
    """A ``VllmEngine`` (not started) on CUDA, or on a CPU build of vLLM when it was asked for."""
    path = fetch(request.resolved, request.env)
    return VllmEngine(vllm_engine_config(request.resolved, path, request.tp_degree, request.env))


def build_vllm_neuron_engine(request: registry.BuildRequest) -> VllmEngine:
    """vLLM on Neuron: the NeuronCores' tensor-parallel degree, LMI's n_positions default
    (``min(max_position_embeddings, 4096)``: a Neuron compile is sized by it),
    ``override_neuron_config`` and the compiled-artifacts folder. Sets ``NEURON_COMPILED_ARTIFACTS``
    in this process's environment, which vLLM's engine process inherits."""
    path = fetch(request.resolved, request.env)
    resolved = with_model_defaults(request.resolved, path)
    neuron = resolved.config.neuron
    setup = neuron_platform_setup(
        vllm_engine_config(resolved, path, request.tp_degree, request.env, gpu_defaults=False),
        neuron.override_neuron_config,
        neuron.compiled_graph_path,
        read_config_json(path),
        writable_cache_root(),
    )
    for key, value in setup.env.items():
        log.info("vllm-neuron: %s=%s", key, value)
        os.environ[key] = value
    return VllmEngine(setup.config)


registry.register("vllm", build_vllm_engine)
registry.register("vllm-neuron", build_vllm_neuron_engine)
