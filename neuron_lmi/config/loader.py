"""Build one :class:`ServingConfig` from CLI flags, ``serving.properties``, the environment and defaults.

Precedence, per field: **CLI > serving.properties > environment > default**. (LMI itself lets
serving.properties win over ``OPTION_*`` variables too; the one difference is that neuron-lmi's CLI
flags sit above both, so ``neuron-lmi serve --tensor-parallel-degree 2`` always means 2.) Only the
winning value of a field is validated: a bad environment value shadowed by a good CLI flag is not an
error. Every ``option.*``/non-option properties key and every ``OPTION_*``/``SERVING_*`` variable
that the key table does not claim is listed in ``ResolvedConfig.ignored`` and logged once, except
when the vLLM backend is asked for (``--backend vllm``, ``option.backend=vllm`` or
``option.rolling_batch=vllm``/``lmi-dist``): LMI passes every ``option.<AsyncEngineArgs field>`` to
vLLM, so the unclaimed ``option.*``/``OPTION_*`` keys are vLLM's to judge (``ResolvedConfig.backend_options``;
``gpu_fallback.config`` type-checks them and reports the ones vLLM does not know), and LMI's
``option.quantize`` is left to vLLM (its ``quantization``: awq, gptq, fp8...) rather than validated
as a Neuron setting. Those keys are kept, raw, in ``ResolvedConfig.vllm_options`` whatever was asked
for, so that vLLM chosen by dispatch alone (``auto`` on a CUDA host) gets them too: serving.properties
is read here once, and no backend reads it again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError

from neuron_lmi.config.hf_config import max_position_embeddings, read_hf_config
from neuron_lmi.config.keys import BY_LMI, KEYS, env_lookup, lookup
from neuron_lmi.config.options import (
    ConfigError,
    ServingConfig,
    default_n_positions,
    default_n_positions_source,
)
from neuron_lmi.config.sources import (
    CLI,
    PROPERTIES_NAME,
    Origin,
    format_properties,
    holds_weights,
    properties_label,
    read_properties,
    sagemaker_model_dir,
    write_text_atomic,
)
from neuron_lmi.config.vllm_keys import (
    VLLM_RELEASED_FIELDS,
    asks_for_vllm,
    backend_option_origins,
    bare_option,
)

logger = logging.getLogger(__name__)

DEFAULT = "default"
MASK = "********"


@dataclass(frozen=True)
class ResolvedConfig:
    """A validated config plus provenance.

    Invariants: ``sources`` has one entry per config field (bare field name → ``"cli"``,
    ``"serving.properties:<path>"``, ``"env:<VAR>"``, ``"model_dir:<dir>"`` or a label starting with
    ``"default"``); ``ignored`` maps each unsupported key, as written, to where it was found;
    ``properties_path`` is the file that was read, if any; ``keys`` maps each field that did not come
    from a default to its name as written there (``OPTION_N_POSITIONS``, ``--n-positions``...);
    ``vllm_options`` maps the bare lower-case name of each ``option.*`` key and ``OPTION_*`` variable
    the table does not claim, and of each shared key vLLM reads itself (``VLLM_RELEASED_FIELDS``,
    from any source), to its raw value and source: what vLLM takes as its engine arguments when it
    serves. ``vllm_asked`` says whether the vLLM backend was asked for; only then are those keys
    left out of ``ignored`` and the released fields left at their defaults in ``config``.
    """

    config: ServingConfig
    sources: Mapping[str, str]
    ignored: Mapping[str, str] = field(default_factory=dict)
    properties_path: Path | None = None
    keys: Mapping[str, str] = field(default_factory=dict)
    vllm_options: Mapping[str, Origin] = field(default_factory=dict)
    vllm_asked: bool = False

    @property
    def backend_options(self) -> Mapping[str, Origin]:
        """``vllm_options`` when the vLLM backend was asked for (none of them is in ``ignored``),
        else empty: what ``--print-config`` lists as vLLM engine arguments."""
        return self.vllm_options if self.vllm_asked else {}

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        return tuple(sorted(self.ignored))

    def source_of(self, field_name: str) -> str:
        return self.sources[field_name]


def cli_overrides(args: Mapping[str, Any] | Any) -> dict[str, Any]:
    """Pick the config fields out of an argparse Namespace (or dict): known names, values not None."""
    items = vars(args) if not isinstance(args, Mapping) else args
    return {name: value for name, value in items.items() if value is not None and lookup(name)}


def _collect_cli(cli: Mapping[str, Any], origins: dict[str, Origin]) -> None:
    for name, value in cli.items():
        if value is None:
            continue
        spec = lookup(name)
        if spec is None:
            raise ConfigError(name, value, CLI, "not a neuron-lmi configuration option")
        origins[spec.field] = Origin("--" + name.removeprefix("option.").replace("_", "-"), value, CLI)


def _is_alias(key: str) -> bool:
    spec = BY_LMI.get(key.strip().lower())
    return spec is not None and key.strip().lower() != spec.lmi.lower()


def _collect_properties(
    values: Mapping[str, str], label: str, origins: dict[str, Origin], ignored: dict[str, str]
) -> None:
    # A field's own key before its aliases: option.n_positions wins over option.max_model_len.
    for key, value in sorted(values.items(), key=lambda kv: _is_alias(kv[0])):
        spec = BY_LMI.get(key.strip().lower())
        if spec is None:
            ignored[key] = label
        elif spec.field not in origins:
            origins[spec.field] = Origin(key, value, label)


def _collect_env(env: Mapping[str, str], origins: dict[str, Origin], ignored: dict[str, str]) -> None:
    found, unclaimed = env_lookup(env)
    for field_name, (var, value) in found.items():
        origins.setdefault(field_name, Origin(var, value, f"env:{var}"))
    for var in unclaimed:
        ignored[var] = f"env:{var}"


def _validate(origins: Mapping[str, Origin]) -> ServingConfig:
    """Validate the winning raw values; map pydantic's first error back to its key and source."""
    nested: dict[str, dict[str, Any]] = {}
    for spec in KEYS:
        if spec.field in origins:
            nested.setdefault(spec.section, {})[spec.field] = origins[spec.field].value
    try:
        return ServingConfig.model_validate(nested)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        field_name = str(first["loc"][1]) if len(first["loc"]) > 1 else ""
        origin = origins.get(field_name, Origin(field_name, first.get("input"), "?"))
        reason = str(first["msg"]).removeprefix("Value error, ")
        where = {".".join(map(str, e["loc"][:2])) for e in errors}
        others = sorted(where - {".".join(map(str, first["loc"][:2]))})
        if others:
            reason += f" (also invalid: {', '.join(others)})"
        value = origin.value.get_secret_value() if isinstance(origin.value, SecretStr) else origin.value
        if field_name == "api_key":
            value = MASK
        raise ConfigError(origin.key, value, origin.source, reason) from None


def _check_combinations(config: ServingConfig, origins: Mapping[str, Origin]) -> None:
    """Rules that span fields, reported against the field the user is most likely to change."""
    batching = config.batching

    def fail(field_name: str, value: Any, reason: str) -> None:
        origin = origins.get(field_name, Origin(BY_FIELD_LMI[field_name], value, DEFAULT))
        raise ConfigError(origin.key, origin.value, origin.source, reason)

    estimate = batching.context_length_estimate
    if batching.n_positions is not None and estimate and estimate[-1] > batching.n_positions:
        limit = batching.n_positions
        fail("context_length_estimate", estimate, f"largest estimate exceeds n_positions={limit}")
    if batching.rolling and batching.batch_size not in (None, batching.max_rolling_batch_size):
        fail(
            "batch_size",
            batching.batch_size,
            f"with rolling batch the compiled batch is max_rolling_batch_size="
            f"{batching.max_rolling_batch_size}; leave batch_size unset or make them equal",
        )
    if batching.speculative_draft_model is not None and batching.speculative_config is not None:
        fail(
            "speculative_draft_model",
            batching.speculative_draft_model,
            "option.speculative_config is set too: give the draft model in one of them",
        )
    if batching.speculative_length is not None and batching.speculative_draft_model is None:
        fail("speculative_length", batching.speculative_length, "needs option.speculative_draft_model")
    if batching.speculative_draft_model is not None and not batching.speculative_draft_model.strip():
        fail("speculative_draft_model", batching.speculative_draft_model, "must name the draft model")
    lora = config.lora
    if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        fail("max_cpu_loras", lora.max_cpu_loras, f"must be at least max_loras={lora.max_loras}")


BY_FIELD_LMI = {spec.field: spec.lmi for spec in KEYS}


def _source(origins: Mapping[str, Origin], field_name: str) -> str:
    return origins[field_name].source if field_name in origins else DEFAULT


def _model_dir_candidates(properties_path: Path | None, env: Mapping[str, str]) -> list[Path]:
    candidates = [properties_path.parent] if properties_path is not None else []
    sm_dir = sagemaker_model_dir(env)
    if sm_dir not in candidates:
        candidates.append(sm_dir)
    return candidates


def _local_max_positions(model_id: str | None) -> int | None:
    """``max_position_embeddings`` from a local Hugging Face directory, without importing transformers;
    None for anything else (a built-in name, a GGUF file, ``s3://``, a Hub id) or an unreadable one."""
    if not model_id or not Path(model_id).is_dir():
        return None
    try:
        return max_position_embeddings(read_hf_config(model_id, "the configuration"))
    except (OSError, ValueError):
        return None


def load_config(
    cli: Mapping[str, Any] | None = None,
    properties_path: Path | str | None = None,
    env: Mapping[str, str] | None = None,
) -> ResolvedConfig:
    """Resolve the serving configuration.

    ``cli`` maps field names or LMI keys to values (None values are skipped); ``properties_path`` an
    explicit serving.properties (else ``$SM_MODEL_DIR``/``/opt/ml/model``'s one is read when present);
    ``env`` defaults to ``os.environ``. When no source names a model and the properties directory or
    the SageMaker model directory holds weights (``config.json`` or ``*.gguf``), that directory is the
    model. ``n_positions`` is filled from a local model's ``max_position_embeddings`` when it can be
    read now; otherwise call :func:`apply_model_defaults` once the model is fetched.

    Raises ConfigError (a ValueError) naming key, value and source for any bad value.
    """
    env = os.environ if env is None else env
    origins: dict[str, Origin] = {}
    ignored: dict[str, str] = {}
    _collect_cli(cli or {}, origins)

    path = Path(properties_path) if properties_path is not None else None
    if path is not None and path.is_dir():
        path = path / PROPERTIES_NAME
    if path is None:
        default_path = sagemaker_model_dir(env) / PROPERTIES_NAME
        path = default_path if default_path.is_file() else None
    properties = read_properties(path) if path is not None else {}
    label = properties_label(path) if path is not None else ""
    _collect_properties(properties, label, origins, ignored)
    _collect_env(env, origins, ignored)
    vllm_options = backend_option_origins(properties, label, env, VLLM_RELEASED_FIELDS)
    vllm_options.update({k: o for k, o in origins.items() if k in VLLM_RELEASED_FIELDS and o.source == CLI})
    vllm_asked = asks_for_vllm(origins)
    if vllm_asked:
        for released in VLLM_RELEASED_FIELDS:
            origins.pop(released, None)
        ignored = {k: v for k, v in ignored.items() if bare_option(k) not in vllm_options}

    if "model_id" not in origins:
        for folder in _model_dir_candidates(path, env):
            if holds_weights(folder):
                origins["model_id"] = Origin(str(folder), str(folder), f"model_dir:{folder}")
                break

    config = _validate(origins)
    _check_combinations(config, origins)
    resolved = ResolvedConfig(
        config=config,
        sources={spec.field: _source(origins, spec.field) for spec in KEYS},
        ignored=dict(sorted(ignored.items())),
        properties_path=path,
        keys={name: origin.key for name, origin in origins.items()},
        vllm_options=dict(sorted(vllm_options.items())),
        vllm_asked=vllm_asked,
    )
    if ignored:
        listed = ", ".join(f"{name} ({where})" for name, where in resolved.ignored.items())
        logger.warning("ignoring configuration keys neuron-lmi does not support: %s", listed)
    max_positions = _local_max_positions(config.model.model_id)
    if max_positions is not None:
        resolved = apply_model_defaults(resolved, max_positions)
    return resolved


def apply_model_defaults(resolved: ResolvedConfig, max_position_embeddings: int | None) -> ResolvedConfig:
    """Fill ``n_positions`` with LMI's smart default when no source set it; a no-op otherwise.

    ``min(max_position_embeddings, 4096)``, or 2048 when the model's limit is unknown (None). The
    source becomes ``"default:min(max_position_embeddings=N, 4096)"`` (or ``"default:2048"``).
    """
    if resolved.config.batching.n_positions is not None:
        return resolved
    value = default_n_positions(max_position_embeddings)
    label = default_n_positions_source(max_position_embeddings)
    batching = resolved.config.batching.model_copy(update={"n_positions": value})
    config = resolved.config.model_copy(update={"batching": batching})
    estimate = batching.context_length_estimate
    if estimate and estimate[-1] > value:
        raise ConfigError(
            resolved.keys.get("context_length_estimate", BY_FIELD_LMI["context_length_estimate"]),
            ",".join(map(str, estimate)),
            resolved.sources["context_length_estimate"],
            f"largest estimate exceeds the default n_positions={value} ({label}); set option.n_positions",
        )
    return replace(resolved, config=config, sources={**resolved.sources, "n_positions": label})


def _display(value: Any) -> str:
    if isinstance(value, SecretStr):
        return MASK
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):  # lora_modules' pairs as name=path, which reads back the same
        return ",".join("=".join(v) if isinstance(v, tuple) else str(v) for v in value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def format_config(resolved: ResolvedConfig) -> str:
    """Human-readable ``--print-config`` text: every field, its value and its source; secrets masked."""
    rows = []
    for spec in KEYS:
        value = getattr(getattr(resolved.config, spec.section), spec.field)
        shown = MASK if spec.secret and value is not None else ("-" if value is None else _display(value))
        rows.append((f"{spec.path} ({spec.lmi})", shown, resolved.sources[spec.field]))
    width = max(len(r[0]) for r in rows)
    value_width = min(max(len(r[1]) for r in rows), 48)
    lines = [f"{name:<{width}}  {shown:<{value_width}}  <- {source}" for name, shown, source in rows]
    if resolved.properties_path is not None:
        lines.insert(0, f"# read {resolved.properties_path}")
    for origin in resolved.backend_options.values():
        lines.append(
            f"vllm engine argument: {origin.key}={origin.value} (from {origin.source}): "
            "checked against vLLM's AsyncEngineArgs at start-up"
        )
    for name, where in resolved.ignored.items():
        lines.append(f"ignored: {name} (from {where}): not supported by neuron-lmi")
    return "\n".join(lines) + "\n"


def _explicit_values(source: ServingConfig | ResolvedConfig | Mapping[str, Any]) -> dict[str, Any]:
    """``{field: typed value}`` for what should be written: set fields only, never secrets."""
    if isinstance(source, ResolvedConfig):
        config = source.config
        wanted = {f for f, label in source.sources.items() if label != DEFAULT}
    elif isinstance(source, ServingConfig):
        config = source
        wanted = {f for name in type(config).model_fields for f in getattr(config, name).model_fields_set}
    else:
        origins: dict[str, Origin] = {}
        for key, value in source.items():
            spec = lookup(key)
            if spec is None:
                raise ConfigError(key, value, "write_properties", "not a neuron-lmi configuration key")
            if value is not None:
                origins[spec.field] = Origin(key, value, "write_properties")
        config = _validate(origins)
        _check_combinations(config, origins)
        wanted = set(origins)
    out: dict[str, Any] = {}
    for spec in KEYS:
        value = getattr(getattr(config, spec.section), spec.field)
        if spec.field in wanted and value is not None:
            if spec.secret:
                logger.warning("not writing %s to serving.properties; pass it at run time", spec.lmi)
                continue
            out[spec.field] = value
    return out


def write_properties(
    source: ServingConfig | ResolvedConfig | Mapping[str, Any], path: Path | str, header: str | None = None
) -> dict[str, str]:
    """Write an LMI ``serving.properties`` (atomically) and return the ``{key: value}`` written.

    From a ResolvedConfig, every field whose source is not the plain ``"default"`` (so a smart-default
    ``n_positions`` is pinned); from a ServingConfig, the fields that were set; ``engine`` always; from a
    mapping (field names or LMI keys), every non-None entry, validated exactly as ``load_config``
    would. Secrets (``api_key``) are never written. Raises ConfigError for unknown keys or bad values.
    """
    values = _explicit_values(source)
    rendered = {BY_FIELD_LMI[name]: _display(value) for name, value in values.items()}
    rendered.setdefault("engine", "Python")
    write_text_atomic(Path(path), format_properties(rendered, header or "written by neuron-lmi"))
    return rendered
