"""The one table from LMI's names (properties keys, environment variables, CLI names) to config fields.

Nothing else in the project reads these environment variables for configuration: the loader walks
:data:`KEYS` and nothing more. A properties key or ``OPTION_*``/``SERVING_*`` variable that no entry
claims is reported as ignored.

Invariants (checked at import): field names are unique across sections, so ``ResolvedConfig.sources``
can be keyed by the bare field name; every entry names a real field; no two entries (names or
aliases) claim the same properties key or environment variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from neuron_lmi.config.options import SECTIONS


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One configurable field.

    ``lmi`` is the serving.properties key (``option.x`` for model options, a bare name for LMI's
    non-option keys); ``env`` the environment variables read for it, in priority order (the generic
    ``OPTION_X``/``SERVING_X`` spelling is derived from ``lmi`` and always comes first); ``secret``
    marks values that are masked when printed and never written to a properties file.
    ``aliases`` are LMI's other properties keys for the same field (``option.max_model_len``, LMI's
    vLLM name for ``option.n_positions``), read after ``lmi`` in the same source, with their generic
    variables after the generic one; only ``lmi`` is ever written.
    """

    section: str
    field: str
    lmi: str
    env: tuple[str, ...] = ()
    secret: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return f"{self.section}.{self.field}"

    @property
    def generic_env(self) -> str:
        """``option.n_positions`` → ``OPTION_N_POSITIONS``; ``engine`` → ``SERVING_ENGINE``."""
        return _generic_env(self.lmi)

    @property
    def env_names(self) -> tuple[str, ...]:
        return (self.generic_env, *map(_generic_env, self.aliases), *self.env)

    @property
    def properties_keys(self) -> tuple[str, ...]:
        """Every serving.properties key that sets this field, ``lmi`` first."""
        return (self.lmi, *self.aliases)


def _generic_env(key: str) -> str:
    if key.startswith("option."):
        return "OPTION_" + key.removeprefix("option.").upper()
    return "SERVING_" + key.upper()


def _opt(
    section: str, field: str, *env: str, name: str | None = None, aliases: tuple[str, ...] = ()
) -> KeySpec:
    return KeySpec(section, field, f"option.{name or field}", tuple(env), aliases=aliases)


def _srv(section: str, field: str, *env: str, name: str | None = None, secret: bool = False) -> KeySpec:
    return KeySpec(section, field, name or field, tuple(env), secret)


KEYS: tuple[KeySpec, ...] = (
    # model
    _opt("model", "model_id", "HF_MODEL_ID"),
    _opt("model", "revision", "HF_REVISION"),
    _opt("model", "dtype"),
    _opt("model", "trust_remote_code", "HF_MODEL_TRUST_REMOTE_CODE"),
    _opt("model", "model_loading_timeout"),
    _opt("model", "enforce_eager"),
    # batching
    _opt("batching", "rolling_batch"),
    _opt("batching", "max_rolling_batch_size", "MAX_BATCH_SIZE"),
    _opt("batching", "batch_size"),
    _opt("batching", "n_positions", aliases=("option.max_model_len",)),
    _opt("batching", "context_length_estimate"),
    _srv("batching", "max_queue_size", name="job_queue_size"),
    _opt("batching", "max_prefill_tokens"),
    _opt("batching", "speculative_config"),
    _opt("batching", "speculative_draft_model"),
    _opt("batching", "speculative_length"),
    # parallel: SM_NUM_GPUS is how SageMaker GPU images pass the device count
    _opt("parallel", "tensor_parallel_degree", "TENSOR_PARALLEL_DEGREE", "SM_NUM_GPUS"),
    _opt("parallel", "group_query_attention"),
    # neuron
    _opt("neuron", "model_loader"),
    _opt("neuron", "override_neuron_config"),
    _opt("neuron", "on_device_sampling"),
    _opt("neuron", "save_sharded_checkpoint"),
    _opt("neuron", "logical_nc_config", "NEURON_LOGICAL_NC_CONFIG"),
    _opt("neuron", "compiled_graph_path", "NEURON_COMPILED_ARTIFACTS"),
    _opt("neuron", "save_mp_checkpoint_path"),
    _opt("neuron", "neuron_optimize_level"),
    _opt("neuron", "enable_saturate_infinity"),
    _opt("neuron", "enable_mixed_precision_accumulation"),
    _opt("neuron", "quantize"),
    _opt("neuron", "fuse_qkv"),
    _opt("neuron", "neuron_platform"),
    _opt("neuron", "allow_unsupported_nxdi_on_inf2_trn1"),
    _opt("neuron", "nxdi_profile"),
    # backend
    _opt("backend", "backend"),
    _srv("backend", "engine"),
    # server: LMI's non-option keys, SERVING_* in the environment
    _srv("server", "host"),
    _srv("server", "port"),
    _srv("server", "api_key", "NEURON_LMI_API_KEY", secret=True),
    _srv("server", "max_body_bytes"),
    _srv("server", "fail_fast"),
    _srv("server", "grace_period_s"),
    _srv("server", "sagemaker"),
    # tool calling (LMI's vLLM keys; our server reads them on every backend)
    _opt("server", "tool_call_parser"),
    _opt("server", "enable_auto_tool_choice"),
    # reasoning output (LMI's vLLM key; our server splits it on every backend)
    _opt("server", "reasoning_parser"),
    # vLLM's own settings under LMI's names (read by the vLLM backends only)
    _opt("vllm", "gpu_memory_utilization"),
    _opt("vllm", "chat_template"),
    _opt("vllm", "seed"),
    _opt("vllm", "served_model_name"),
    # LoRA adapters (LMI's and vLLM's names; vLLM reads them itself too: VLLM_RELEASED_FIELDS)
    _opt("lora", "enable_lora"),
    _opt("lora", "max_loras"),
    _opt("lora", "max_lora_rank"),
    _opt("lora", "max_cpu_loras"),
    _opt("lora", "lora_modules"),
)

BY_FIELD: dict[str, KeySpec] = {spec.field: spec for spec in KEYS}
BY_LMI: dict[str, KeySpec] = {key.lower(): spec for spec in KEYS for key in spec.properties_keys}

# Environment variables that SM_NUM_GPUS-style aliases may carry as "not set": SageMaker CPU and
# Neuron hosts can export SM_NUM_GPUS=0, which must not become tensor_parallel_degree=0.
ZERO_MEANS_UNSET = frozenset({"SM_NUM_GPUS"})


def _check_table() -> None:
    """Fail at import, not at serve time, if the table and the models drift apart."""
    if len(BY_FIELD) != len(KEYS) or len(BY_LMI) != sum(len(spec.properties_keys) for spec in KEYS):
        raise RuntimeError("config KEYS: duplicate field or properties key")
    env_names = [name for spec in KEYS for name in spec.env_names]
    if len(env_names) != len(set(env_names)):
        raise RuntimeError("config KEYS: one environment variable claimed by two fields")
    for spec in KEYS:
        if spec.field not in SECTIONS[spec.section].model_fields:
            raise RuntimeError(f"config KEYS: {spec.path} is not a field")
    declared = {name for model in SECTIONS.values() for name in model.model_fields}
    if declared != set(BY_FIELD):
        raise RuntimeError(f"config KEYS: fields without an LMI name: {sorted(declared - set(BY_FIELD))}")


_check_table()


def lookup(name: str) -> KeySpec | None:
    """The entry for a properties key or CLI name: ``option.n_positions``, ``n_positions``,
    ``n-positions``, ``job_queue_size`` and ``max_queue_size`` all resolve; None when unknown."""
    key = name.strip().lower().replace("-", "_")
    if key in BY_LMI:
        return BY_LMI[key]
    short = key.removeprefix("option.")
    return BY_FIELD.get(short) or BY_LMI.get(f"option.{short}")


def env_lookup(env: Mapping[str, str]) -> tuple[dict[str, tuple[str, str]], list[str]]:
    """Read the environment through the table.

    Returns ``({field: (variable, value)}, ignored)`` where ``ignored`` lists the ``OPTION_*`` and
    ``SERVING_*`` variables no entry claims. For each field the first set variable in
    ``spec.env_names`` wins. Empty values count as unset.
    """
    found: dict[str, tuple[str, str]] = {}
    for spec in KEYS:
        for var in spec.env_names:
            value = env.get(var)
            if value is None or not value.strip():
                continue
            if var in ZERO_MEANS_UNSET and value.strip() == "0":
                continue
            found[spec.field] = (var, value)
            break
    claimed = {var for spec in KEYS for var in spec.env_names}
    ignored = sorted(var for var in env if var.startswith(("OPTION_", "SERVING_")) and var not in claimed)
    return found, ignored
