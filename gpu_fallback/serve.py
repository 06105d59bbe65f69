"""Build a ``VllmEngine`` from the server's resolved configuration (``neuron-lmi serve --backend vllm``).

``build_vllm_engine(resolved, env)`` has the signature of ``neuron_lmi.commands.serve.ENGINE_BUILDERS``
entries. vLLM-only LMI keys that the shared configuration does not model
(``option.gpu_memory_utilization``, ``option.enforce_eager``, ``option.chat_template``,
``option.max_model_len``) are read here, from serving.properties and then ``OPTION_*`` variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpu_fallback.config import VllmEngineConfig
from gpu_fallback.engine import VllmEngine

VLLM_ONLY_KEYS = ("gpu_memory_utilization", "enforce_eager", "chat_template", "max_model_len")


def vllm_only_options(properties_path: Path | None, env: Mapping[str, str]) -> dict[str, str]:
    """The vLLM-only keys, environment first then serving.properties (which wins, as in LMI)."""
    found: dict[str, str] = {}
    for key in VLLM_ONLY_KEYS:
        value = env.get(f"OPTION_{key.upper()}")
        if value is not None:
            found[key] = value
    if properties_path is not None and Path(properties_path).is_file():
        from neuron_lmi.config.sources import read_properties

        props = read_properties(Path(properties_path))
        found.update({k: props[f"option.{k}"] for k in VLLM_ONLY_KEYS if f"option.{k}" in props})
    return found


def build_vllm_engine(resolved: Any, env: Mapping[str, str] | None = None) -> VllmEngine:
    """A ``VllmEngine`` (not started) for the resolved serving configuration."""
    from neuron_lmi.model_source import fetch_model

    env = os.environ if env is None else env
    cfg = resolved.config
    model_id = cfg.model.model_id or "smollm2"
    cache = Path(env.get("NEURON_LMI_MODEL_CACHE") or Path.home() / ".cache" / "neuron-lmi" / "models")
    path = fetch_model(model_id, cache, cfg.model.model_loading_timeout, env, revision=cfg.model.revision)
    # LMI's default dtype (fp16) is a Neuron default; on vLLM, unless asked, use the checkpoint's own.
    dtype = "auto" if resolved.source_of("dtype").startswith("default") else cfg.model.dtype
    options: dict[str, Any] = {
        "tensor_parallel_degree": cfg.parallel.tensor_parallel_degree,
        "max_rolling_batch_size": cfg.batching.max_rolling_batch_size,
        "n_positions": cfg.batching.n_positions,
        "dtype": dtype,
        "trust_remote_code": cfg.model.trust_remote_code,
        "max_queue_size": cfg.batching.max_queue_size,
        **vllm_only_options(resolved.properties_path, env),
    }
    config = VllmEngineConfig.from_lmi(options, model=str(path), served_model_name=model_id)
    return VllmEngine(config)


def register(builders: dict[str, Any]) -> None:
    """Add the vLLM builder to a serve command's builder table unless it has one already."""
    builders.setdefault("vllm", build_vllm_engine)


def main(argv: list[str] | None = None) -> int:
    """``python -m gpu_fallback.serve serve --backend vllm ...``: the neuron-lmi CLI with vLLM registered.

    For checkouts whose ``neuron_lmi.commands.serve.ENGINE_BUILDERS`` does not list vLLM yet.
    """
    import sys

    from neuron_lmi.cli import main as cli_main
    from neuron_lmi.commands import serve

    register(serve.ENGINE_BUILDERS)
    return cli_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":  # vLLM's worker processes re-import the caller: start nothing on import
    raise SystemExit(main())
