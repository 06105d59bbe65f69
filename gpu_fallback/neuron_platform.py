"""The vLLM engine configured for AWS Neuron: vLLM with the ``vllm-neuron`` platform plugin.

The same ``VllmEngine`` as on CUDA; only its engine arguments and environment differ. Nothing here
imports vLLM or a Neuron package. Facts used, read in vllm-project/vllm-neuron (v0.2.0, vLLM 0.11):

* the platform is chosen by the plugin's entry point (``vllm.platform_plugins``: ``neuron``), which
  activates wherever ``/dev/neuron*`` exists: no ``device`` engine argument is needed;
* ``additional_config["override_neuron_config"]`` is merged last into NxD Inference's NeuronConfig
  (``worker/neuronx_distributed_model_loader.py``); we pass LMI's ``option.override_neuron_config``;
* compiled artifacts are read from, or compiled into, ``$NEURON_COMPILED_ARTIFACTS``. Without it the
  loader uses ``<model>/neuron-compiled-artifacts/<hash>``, which it empties first (so nothing is
  ever reused) and which cannot be written under SageMaker's read-only ``/opt/ml/model``; and an
  existing directory is loaded whatever configuration compiled it. So when LMI's
  ``option.compiled_graph_path`` is unset we point it at a folder of the writable compile cache
  named by a hash of everything that shapes the compile;
* with prefix caching off (our default, as in the plugin's server example) the KV block size is
  ``max_model_len``, and the README asks for ``num_gpu_blocks_override = max_num_seqs`` then
  (``ceil(max_model_len / block_size) * max_num_seqs``) to avoid an out-of-bounds error; with prefix
  caching on the plugin requires ``block_size``.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Any

from gpu_fallback.config import VllmEngineConfig

ARTIFACTS_VAR = "NEURON_COMPILED_ARTIFACTS"
ARTIFACTS_FOLDER = "vllm-neuron"
VERSIONED = ("vllm", "vllm-neuron", "neuronx-distributed-inference", "neuronx-cc")


@dataclass(frozen=True, slots=True)
class NeuronPlatformSetup:
    """The engine configuration for the Neuron platform and the environment its engine core needs
    (set before vLLM starts its engine process, which inherits it)."""

    config: VllmEngineConfig
    env: dict[str, str]


def neuron_engine_args(
    config: VllmEngineConfig, override_neuron_config: Mapping[str, Any] | None
) -> dict[str, Any]:
    """``extra_engine_args`` for vllm-neuron: ``additional_config`` carrying the override (merged over
    one the user passed), prefix caching off unless asked for, and the KV block count the plugin
    needs. Arguments the user set win, except that the override is merged key by key."""
    extra = dict(config.extra_engine_args)
    additional = dict(extra.get("additional_config") or {})
    if override_neuron_config:
        merged = {**(additional.get("override_neuron_config") or {}), **dict(override_neuron_config)}
        additional["override_neuron_config"] = merged
    if additional:
        extra["additional_config"] = additional
    extra.setdefault("enable_prefix_caching", False)
    if "num_gpu_blocks_override" not in extra:
        if not extra["enable_prefix_caching"]:
            extra["num_gpu_blocks_override"] = config.max_rolling_batch_size
        elif extra.get("block_size") and config.n_positions:
            blocks = math.ceil(config.n_positions / int(extra["block_size"]))
            extra["num_gpu_blocks_override"] = blocks * config.max_rolling_batch_size
        else:
            raise ValueError(
                "enable_prefix_caching on Neuron needs option.block_size and option.n_positions "
                "(vllm-neuron sizes its KV blocks from them)"
            )
    return extra


def artifacts_dir(
    config: VllmEngineConfig,
    extra: Mapping[str, Any],
    model_config: Mapping[str, Any],
    root: Path,
    versions: Mapping[str, str | None] | None = None,
) -> Path:
    """``<root>/vllm-neuron/<hash>``: a folder per model architecture, engine shape, Neuron
    override and library versions, so a changed setting never loads another compile's artifacts."""
    described = {
        "model_config": {k: v for k, v in model_config.items() if k not in ("_name_or_path",)},
        "model": str(config.model),
        "tensor_parallel_degree": config.tensor_parallel_degree,
        "max_num_seqs": config.max_rolling_batch_size,
        "max_model_len": config.n_positions,
        "dtype": config.dtype,
        "engine_args": {k: v for k, v in extra.items()},
        "versions": dict(versions if versions is not None else installed_versions()),
    }
    text = json.dumps(described, sort_keys=True, separators=(",", ":"), default=str)
    return root / ARTIFACTS_FOLDER / hashlib.sha256(text.encode()).hexdigest()[:24]


def installed_versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def neuron_platform_setup(
    config: VllmEngineConfig,
    override_neuron_config: Mapping[str, Any] | None,
    compiled_graph_path: str | None,
    model_config: Mapping[str, Any],
    cache_root: Path,
    versions: Mapping[str, str | None] | None = None,
) -> NeuronPlatformSetup:
    """``config`` (built as for CUDA, tensor-parallel degree already resolved to NeuronCores) made
    ready for vllm-neuron. ``compiled_graph_path`` (LMI's ``option.compiled_graph_path`` or
    ``NEURON_COMPILED_ARTIFACTS``) must be a local folder: the plugin reads it with ``os.path``."""
    if compiled_graph_path and "://" in compiled_graph_path:
        raise ValueError(
            f"option.compiled_graph_path={compiled_graph_path!r}: vLLM on Neuron reads compiled "
            "artifacts from a local folder (NEURON_COMPILED_ARTIFACTS); copy them to the host first"
        )
    extra = neuron_engine_args(config, override_neuron_config)
    artifacts = compiled_graph_path or str(artifacts_dir(config, extra, model_config, cache_root, versions))
    return NeuronPlatformSetup(replace(config, extra_engine_args=extra), {ARTIFACTS_VAR: artifacts})
