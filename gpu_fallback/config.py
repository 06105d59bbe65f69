"""Configuration of the vLLM backend and its mapping onto vLLM's engine arguments.

LMI names (``option.tensor_parallel_degree``, ``option.max_rolling_batch_size``, ``option.n_positions``,
``option.dtype`` and the vLLM-specific ``option.gpu_memory_utilization`` / ``option.enforce_eager`` /
``option.max_model_len`` / ``option.chat_template``) are read through ``LMI_KEYS``. Every other
``option.<name>`` / ``OPTION_<NAME>`` that is a field of vLLM's ``AsyncEngineArgs`` passes through, as
in LMI's vLLM integration, with its value checked against that field's type
(:func:`vllm_engine_options`). Defaults follow LMI on vLLM: 256 rolling-batch rows, every visible GPU,
the model's own maximum length. Only :func:`engine_arg_types` imports vLLM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neuron_lmi.config.dtypes import ALIASES, DTYPES, canonical_dtype

log = logging.getLogger(__name__)

# LMI on vLLM: 256 rows (vLLM's max_num_seqs) unless set (djl-serving's LmiConfigRecommender).
DEFAULT_MAX_ROLLING_BATCH_SIZE = 256
SPAWN_VAR = "VLLM_WORKER_MULTIPROC_METHOD"


def vllm_dtype(name: str) -> str | None:
    """vLLM's name for one of ours (LMI's fp32/fp16/bf16, torch's, ``auto``); None if unknown."""
    if name.strip().lower() == "auto":
        return "auto"
    canonical = canonical_dtype(name)
    return DTYPES[canonical].torch_name if canonical is not None else None


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {value!r}")


def _tp(value: Any) -> int | str:
    return "max" if str(value).strip().lower() == "max" else int(value)


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """What the vLLM backend needs. Invariant: every field is validated in ``__post_init__``.

    ``n_positions`` None lets vLLM use the model's own maximum; ``tensor_parallel_degree`` may be
    "max" (every visible GPU, LMI's default). ``max_queue_size`` bounds requests waiting beyond the
    rolling batch. ``extra_engine_args`` are ``AsyncEngineArgs`` fields, already typed.
    """

    model: str
    served_model_name: str | None = None
    tensor_parallel_degree: int | str = "max"
    max_rolling_batch_size: int = DEFAULT_MAX_ROLLING_BATCH_SIZE
    n_positions: int | None = None
    dtype: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    chat_template: str | None = None
    trust_remote_code: bool = False
    seed: int = 0
    max_queue_size: int = 256
    kv_cache_memory_bytes: int | None = None
    extra_engine_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model directory or file")
        if self.tensor_parallel_degree != "max" and (
            not isinstance(self.tensor_parallel_degree, int) or self.tensor_parallel_degree < 1
        ):
            raise ValueError(
                f"tensor_parallel_degree must be >= 1 or 'max', got {self.tensor_parallel_degree!r}"
            )
        if self.max_rolling_batch_size < 1:
            raise ValueError(f"max_rolling_batch_size must be >= 1, got {self.max_rolling_batch_size!r}")
        if self.n_positions is not None and self.n_positions < 2:
            raise ValueError(f"n_positions must be >= 2, got {self.n_positions!r}")
        if vllm_dtype(self.dtype) is None:
            raise ValueError(f"dtype must be auto or one of {', '.join(ALIASES)}, got {self.dtype!r}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size!r}")

    @classmethod
    def from_lmi(cls, options: Mapping[str, Any], **overrides: Any) -> VllmEngineConfig:
        """Build from LMI keys (with or without the ``option.`` prefix); unknown keys are ignored here."""
        kwargs: dict[str, Any] = {}
        for key, value in options.items():
            if value is None:
                continue
            bare = key[len("option.") :] if key.startswith("option.") else key
            target = LMI_KEYS.get(bare)
            if target is not None:
                name, convert = target
                try:
                    kwargs[name] = convert(value)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"option.{bare}={value!r}: {exc}") from exc
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)


# LMI key -> (our field, conversion). option.max_model_len is LMI's vLLM spelling of n_positions.
LMI_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model_id": ("model", str),
    "served_model_name": ("served_model_name", str),
    "tensor_parallel_degree": ("tensor_parallel_degree", _tp),
    "max_rolling_batch_size": ("max_rolling_batch_size", int),
    "n_positions": ("n_positions", int),
    "max_model_len": ("n_positions", int),
    "dtype": ("dtype", str),
    "enforce_eager": ("enforce_eager", _bool),
    "gpu_memory_utilization": ("gpu_memory_utilization", float),
    "chat_template": ("chat_template", str),
    "trust_remote_code": ("trust_remote_code", _bool),
    "seed": ("seed", int),
    "max_queue_size": ("max_queue_size", int),
}


def engine_args_kwargs(
    config: VllmEngineConfig, model_dir: str | Path, device_count: int = 1
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.AsyncEngineArgs`` (``model_dir`` is the resolved HF directory)."""
    tp = max(1, device_count) if config.tensor_parallel_degree == "max" else config.tensor_parallel_degree
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "served_model_name": config.served_model_name,
        "tensor_parallel_size": tp,
        "max_num_seqs": config.max_rolling_batch_size,
        "max_model_len": config.n_positions,
        "dtype": vllm_dtype(config.dtype),
        "enforce_eager": config.enforce_eager,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "trust_remote_code": config.trust_remote_code,
        "seed": config.seed,
        # Our own stat logger still receives scheduler stats; this only drops vLLM's 5 s log line.
        "disable_log_stats": True,
    }
    if config.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    kwargs.update(config.extra_engine_args)
    return {k: v for k, v in kwargs.items() if v is not None}


def load_chat_template(value: str | None) -> str | None:
    """A chat template given inline or as a path to a Jinja file."""
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    return value


def use_spawn(environ: MutableMapping[str, str]) -> bool:
    """Make vLLM start its engine core with ``spawn`` unless the user chose a method; True if set now.

    vLLM forks by default and switches to spawn only once CUDA is initialised here; a forked child
    of a process that touched the CUDA driver cannot use it. vLLM's own CLI sets spawn the same way
    (``entrypoints/serve/utils/api_utils.py``). Call it before vLLM is imported.
    """
    if SPAWN_VAR in environ:
        return False
    environ[SPAWN_VAR] = "spawn"
    return True


def engine_arg_types() -> dict[str, Any]:
    """``AsyncEngineArgs``' public fields and their annotations. Imports vLLM, so it sets the spawn
    start method first (see :func:`use_spawn`)."""
    import dataclasses

    use_spawn(os.environ)
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name: f.type for f in dataclasses.fields(AsyncEngineArgs) if not f.name.startswith("_")}


# LMI's names for vLLM engine arguments (djl-serving vllm_rb_properties.py).
ENGINE_ARG_ALIASES = {
    "max_rolling_batch_prefill_tokens": "max_num_batched_tokens",
    "quantize": "quantization",
}
# Engine arguments this backend derives from LMI keys; setting them directly would split the two.
OWNED_ENGINE_ARGS = {
    "model": "option.model_id",
    "tokenizer": "option.model_id (the tokenizer is the model's own)",
    "tensor_parallel_size": "option.tensor_parallel_degree",
    "max_num_seqs": "option.max_rolling_batch_size",
}


@dataclass(frozen=True, slots=True)
class VllmOptions:
    """The ``option.*`` keys the shared configuration leaves to the vLLM backend, by consumer.

    ``lmi``: this backend's own LMI keys (``LMI_KEYS``), raw, for ``VllmEngineConfig.from_lmi``;
    ``engine_args``: ``AsyncEngineArgs`` fields, typed; ``sources``: each engine argument's key as
    written and where it came from; ``unknown``: every other key as written -> its source.
    """

    lmi: dict[str, Any] = field(default_factory=dict)
    engine_args: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    return getattr(annotation, "__name__", None) or str(annotation)


def coerce_engine_arg(value: Any, annotation: Any) -> Any:
    """``value`` as a field annotated ``annotation`` takes it: a string from serving.properties or
    the environment is tried as written (``true``, ``8``, ``0.9``, ``fp8``), then as JSON (dicts,
    lists, vLLM's config classes, ``Literal`` numbers). Raises ValueError saying what was expected."""
    from pydantic import TypeAdapter, ValidationError

    candidates = [value]
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            candidates.append(json.loads(value))
    try:
        adapter = TypeAdapter(annotation)
    except Exception:  # a type pydantic cannot describe (a class, a callable): vLLM checks it
        return candidates[-1]
    error: ValidationError | None = None
    for candidate in candidates:
        try:
            return adapter.validate_python(candidate)
        except ValidationError as exc:
            error = error or exc
    reason = error.errors(include_url=False)[0]["msg"] if error is not None else "invalid"
    raise ValueError(f"expected {_type_name(annotation)}: {reason}")


def vllm_engine_options(
    properties: Mapping[str, str],
    env: Mapping[str, str],
    fields: Mapping[str, Any] | None = None,
    label: str = "serving.properties",
) -> VllmOptions:
    """Split the unclaimed ``option.<name>`` / ``OPTION_<NAME>`` keys (serving.properties winning)
    into this backend's LMI keys, typed ``AsyncEngineArgs`` fields (``fields``: name -> annotation,
    vLLM's own by default) and unknown keys. A value of the wrong type raises ``ConfigError``
    naming the key, the value and its source."""
    from neuron_lmi.config.loader import VLLM_RELEASED_FIELDS, backend_option_origins
    from neuron_lmi.config.options import ConfigError

    origins = backend_option_origins(properties, label, env, VLLM_RELEASED_FIELDS)
    fields = engine_arg_types() if fields is None else fields
    out = VllmOptions()
    # Aliases first, so that vLLM's own name wins when both are given.
    for name, origin in sorted(origins.items(), key=lambda kv: kv[0] not in ENGINE_ARG_ALIASES):
        target = ENGINE_ARG_ALIASES.get(name, name)
        if name in LMI_KEYS:
            out.lmi[name] = origin.value
        elif target in OWNED_ENGINE_ARGS:
            reason = f"set by neuron-lmi from {OWNED_ENGINE_ARGS[target]}; set that instead"
            raise ConfigError(origin.key, origin.value, origin.source, reason)
        elif target not in fields:
            out.unknown[origin.key] = origin.source
        else:
            try:
                out.engine_args[target] = coerce_engine_arg(origin.value, fields[target])
            except ValueError as exc:
                raise ConfigError(origin.key, origin.value, origin.source, f"vLLM's {target} {exc}") from None
            out.sources[target] = f"{origin.key} (from {origin.source})"
    return out


def vllm_config_from_resolved(
    resolved: Any,
    env: Mapping[str, str],
    model: str,
    served_model_name: str | None,
    tp_degree: int | None = None,
    gpu_defaults: bool = True,
    fields: Mapping[str, Any] | None = None,
) -> VllmEngineConfig:
    """The engine configuration for ``neuron-lmi serve`` on vLLM.

    With ``gpu_defaults`` (CUDA), what no source set follows LMI on vLLM: every visible GPU, 256
    rows, the model's own maximum length (not the Neuron ``min(max_position_embeddings, 4096)``),
    the checkpoint's dtype. Otherwise ``tp_degree`` (already resolved) and the shared values are
    used as they are (vllm-neuron: a Neuron compile is sized by them). Engine arguments pass through
    (:func:`vllm_engine_options`); unknown keys not already reported by the loader are logged once.
    """
    from neuron_lmi.config.sources import properties_label, read_properties

    cfg = resolved.config

    def unset(name: str) -> bool:
        return resolved.source_of(name).startswith("default")

    tp = cfg.parallel.tensor_parallel_degree if tp_degree is None else tp_degree
    options: dict[str, Any] = {
        "tensor_parallel_degree": "max" if gpu_defaults and unset("tensor_parallel_degree") else tp,
        "max_rolling_batch_size": DEFAULT_MAX_ROLLING_BATCH_SIZE
        if gpu_defaults and unset("max_rolling_batch_size")
        else cfg.batching.max_rolling_batch_size,
        "n_positions": None if gpu_defaults and unset("n_positions") else cfg.batching.n_positions,
        # LMI's default dtype (fp16) is a Neuron default; on vLLM, unless asked, the checkpoint's own.
        "dtype": "auto" if unset("dtype") else cfg.model.dtype,
        "trust_remote_code": cfg.model.trust_remote_code,
        "max_queue_size": cfg.batching.max_queue_size,
    }
    path = resolved.properties_path
    readable = path is not None and Path(path).is_file()
    properties = read_properties(Path(path)) if readable else {}
    label = properties_label(Path(path)) if readable else "serving.properties"
    found = vllm_engine_options(properties, env, fields, label)
    options.update(found.lmi)
    extra = dict(found.engine_args)
    if cfg.batching.max_prefill_tokens is not None:
        extra.setdefault("max_num_batched_tokens", cfg.batching.max_prefill_tokens)
    for name, where in found.sources.items():
        log.info("vLLM engine argument %s=%r from %s", name, extra[name], where)
    fresh = {key: where for key, where in found.unknown.items() if key not in resolved.ignored}
    if fresh:
        listed = ", ".join(f"{key} ({where})" for key, where in fresh.items())
        log.warning("ignoring configuration keys that are not vLLM engine arguments: %s", listed)
    return VllmEngineConfig.from_lmi(
        options, model=model, served_model_name=served_model_name, extra_engine_args=extra
    )
