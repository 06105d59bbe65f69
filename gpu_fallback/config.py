"""Configuration of the vLLM backend and its mapping onto vLLM's engine arguments.

The backend reads the resolved configuration (``neuron_lmi.config.ResolvedConfig``) and nothing
else: the shared fields (``option.tensor_parallel_degree``, ``option.max_rolling_batch_size``,
``option.n_positions`` or LMI's vLLM spelling ``option.max_model_len``, ``option.dtype``,
``option.trust_remote_code``, ``job_queue_size``, ``option.max_prefill_tokens``) and vLLM's own
section (``option.gpu_memory_utilization``, ``option.chat_template``, ``option.seed``,
``option.served_model_name``) arrive typed. Every other ``option.<name>`` / ``OPTION_<NAME>`` that
the loader kept in ``ResolvedConfig.vllm_options`` and that is a field of vLLM's
``AsyncEngineArgs`` passes through, as in LMI's vLLM integration, its value checked against that
field's type (:func:`vllm_engine_options`). The typed LoRA settings (``option.enable_lora``,
``max_loras``, ``max_lora_rank``, ``max_cpu_loras``) and ``option.speculative_config`` map onto
vLLM's fields of the same names (:func:`typed_engine_args`), checked against vLLM's annotations too
(its ``max_lora_rank`` takes 1, 8, 16, 32, 64...). Defaults follow LMI on vLLM: 256 rolling-batch rows,
every visible GPU, the model's own maximum length, the checkpoint's dtype. Only
:func:`engine_arg_types` imports vLLM.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_lmi.config.dtypes import ALIASES, DTYPES, canonical_dtype
from neuron_lmi.config.options import (
    VLLM_DEFAULT_MAX_ROLLING_BATCH_SIZE,
    ConfigError,
)

if TYPE_CHECKING:
    from neuron_lmi.backends.lora import LoraSettings
    from neuron_lmi.config.loader import ResolvedConfig
    from neuron_lmi.config.sources import Origin

log = logging.getLogger(__name__)

SPAWN_VAR = "VLLM_WORKER_MULTIPROC_METHOD"


def vllm_dtype(name: str) -> str | None:
    """vLLM's name for one of ours (LMI's fp32/fp16/bf16, torch's, ``auto``); None if unknown."""
    if name.strip().lower() == "auto":
        return "auto"
    canonical = canonical_dtype(name)
    return DTYPES[canonical].torch_name if canonical is not None else None


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """What the vLLM backend needs. Invariant: every field is validated in ``__post_init__``.

    No field has a default of its own: :func:`vllm_config_from_resolved` builds it from the resolved
    configuration, where LMI-on-vLLM's defaults live (one configuration, issue 37).

    ``n_positions`` None lets vLLM use the model's own maximum; ``tensor_parallel_degree`` may be
    "max" (every visible GPU, LMI's default). ``max_queue_size`` bounds requests waiting beyond the
    rolling batch. ``extra_engine_args`` are ``AsyncEngineArgs`` fields, already typed. ``lora``: the
    LoRA settings and start-up adapters (``backends.lora``), None without ``option.enable_lora``;
    with it ``extra_engine_args`` holds vLLM's ``enable_lora`` and its kin.
    """

    model: str
    served_model_name: str | None
    tensor_parallel_degree: int | str
    max_rolling_batch_size: int
    n_positions: int | None
    dtype: str
    enforce_eager: bool
    gpu_memory_utilization: float
    chat_template: str | None
    trust_remote_code: bool
    seed: int
    max_queue_size: int
    extra_engine_args: Mapping[str, Any]
    lora: LoraSettings | None

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
        if (self.lora is not None) != bool(self.extra_engine_args.get("enable_lora")):
            raise ValueError("lora settings and vLLM's enable_lora must agree")


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
# vLLM engine argument -> the typed field it is mapped from (typed_engine_args); the keys are
# claimed by the shared key table, so none of them reaches vllm_options.
TYPED_ENGINE_ARGS = {
    "enable_lora": "enable_lora",
    "max_loras": "max_loras",
    "max_lora_rank": "max_lora_rank",
    "max_cpu_loras": "max_cpu_loras",
    "speculative_config": "speculative_config",
}


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """``ResolvedConfig.vllm_options`` split for vLLM: ``engine_args``, ``AsyncEngineArgs`` fields,
    typed; ``sources``, each engine argument's key as written and where it came from; ``unknown``,
    every other key as written -> its source."""

    engine_args: dict[str, Any]
    sources: dict[str, str]
    unknown: dict[str, str]


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


def vllm_engine_options(origins: Mapping[str, Origin], fields: Mapping[str, Any] | None = None) -> EngineArgs:
    """Split the keys the loader left to vLLM (``ResolvedConfig.vllm_options``: bare name ->
    ``Origin``) into typed ``AsyncEngineArgs`` fields (``fields``: name -> annotation, vLLM's own by
    default) and unknown keys. A value of the wrong type, or an argument this backend sets itself,
    raises ``ConfigError`` naming the key, the value and its source."""
    fields = engine_arg_types() if fields is None else fields
    out = EngineArgs(engine_args={}, sources={}, unknown={})
    # Aliases first, so that vLLM's own name wins when both are given.
    for name, origin in sorted(origins.items(), key=lambda kv: kv[0] not in ENGINE_ARG_ALIASES):
        target = ENGINE_ARG_ALIASES.get(name, name)
        if target in OWNED_ENGINE_ARGS:
            reason = f"set by neuron-lmi from {OWNED_ENGINE_ARGS[target]}; set that instead"
            raise ConfigError(origin.key, origin.value, origin.source, reason)
        if target not in fields:
            out.unknown[origin.key] = origin.source
            continue
        try:
            out.engine_args[target] = coerce_engine_arg(origin.value, fields[target])
        except ValueError as exc:
            raise ConfigError(origin.key, origin.value, origin.source, f"vLLM's {target} {exc}") from None
        out.sources[target] = f"{origin.key} (from {origin.source})"
    return out


def typed_engine_args(resolved: ResolvedConfig, fields: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's engine arguments from the typed LoRA settings and speculative config (nothing re-read
    or re-parsed), each checked against its ``fields`` annotation where vLLM's are known; a value
    vLLM would refuse raises ``ConfigError`` naming the key as written and its source."""
    cfg = resolved.config
    values: dict[str, Any] = {}
    if cfg.lora.enable_lora:
        lora = cfg.lora
        values |= {
            "enable_lora": True,
            "max_loras": lora.max_loras,
            "max_lora_rank": lora.max_lora_rank,
            "max_cpu_loras": lora.cpu_loras,
        }
    spec = cfg.batching.speculation
    if spec is not None:
        values["speculative_config"] = spec.to_json()
    for name, value in values.items():
        if name not in fields:
            continue
        try:
            values[name] = coerce_engine_arg(value, fields[name])
        except ValueError as exc:
            field_name = TYPED_ENGINE_ARGS[name]
            key = resolved.keys.get(field_name, f"option.{field_name}")
            raise ConfigError(key, value, resolved.source_of(field_name), f"vLLM's {name} {exc}") from None
    return values


def vllm_config_from_resolved(
    resolved: ResolvedConfig,
    model: str,
    served_model_name: str | None,
    tp_degree: int | None = None,
    gpu_defaults: bool = True,
    fields: Mapping[str, Any] | None = None,
    lora: LoraSettings | None = None,
) -> VllmEngineConfig:
    """The engine configuration for ``neuron-lmi serve`` on vLLM, from ``resolved`` alone.

    With ``gpu_defaults`` (CUDA), what no source set follows LMI on vLLM: every visible GPU, 256
    rows, the model's own maximum length (not the Neuron ``min(max_position_embeddings, 4096)``).
    Otherwise ``tp_degree`` (already resolved) and the shared values are used as they are
    (vllm-neuron: a Neuron compile is sized by them). An unset dtype is the checkpoint's own
    (LMI's fp16 is a Neuron default); ``served_model_name`` names the model unless
    ``option.served_model_name`` does. Engine arguments pass through (:func:`vllm_engine_options`);
    unknown keys not already reported by the loader are logged once. ``lora``: the resolved LoRA
    settings (``backends.lora.resolve_lora``), required with ``option.enable_lora``.
    """
    cfg = resolved.config
    fields = engine_arg_types() if fields is None else fields

    def default(name: str) -> bool:
        return resolved.source_of(name).startswith("default")

    def lmi_on_vllm(name: str) -> bool:  # unset, and LMI-on-vLLM defaults apply
        return gpu_defaults and default(name)

    found = vllm_engine_options(resolved.vllm_options, fields)
    extra = dict(found.engine_args) | typed_engine_args(resolved, fields)
    if cfg.batching.max_prefill_tokens is not None:
        extra.setdefault("max_num_batched_tokens", cfg.batching.max_prefill_tokens)
    for name, where in found.sources.items():
        log.info("vLLM engine argument %s=%r from %s", name, extra[name], where)
    fresh = {key: where for key, where in found.unknown.items() if key not in resolved.ignored}
    if fresh:
        listed = ", ".join(f"{key} ({where})" for key, where in fresh.items())
        log.warning("ignoring configuration keys that are not vLLM engine arguments: %s", listed)
    tp = cfg.parallel.tensor_parallel_degree if tp_degree is None else tp_degree
    rows = cfg.batching.max_rolling_batch_size
    if lmi_on_vllm("max_rolling_batch_size"):
        rows = VLLM_DEFAULT_MAX_ROLLING_BATCH_SIZE
    return VllmEngineConfig(
        model=model,
        served_model_name=cfg.vllm.served_model_name or served_model_name,
        tensor_parallel_degree="max" if lmi_on_vllm("tensor_parallel_degree") else tp,
        max_rolling_batch_size=rows,
        n_positions=None if lmi_on_vllm("n_positions") else cfg.batching.n_positions,
        dtype="auto" if default("dtype") else cfg.model.dtype,
        # vLLM's own switch when the loader left it to vLLM (typed above), else the shared one.
        enforce_eager=extra.pop("enforce_eager", cfg.model.enforce_eager),
        gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
        chat_template=cfg.vllm.chat_template,
        trust_remote_code=cfg.model.trust_remote_code,
        seed=cfg.vllm.seed,
        max_queue_size=cfg.batching.max_queue_size,
        extra_engine_args=extra,
        lora=lora,
    )
