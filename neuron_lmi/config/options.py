"""The validated configuration, one pydantic model per concern, all held by :class:`ServingConfig`.

Every model forbids unknown fields and is frozen: a config is built once by
:func:`neuron_lmi.config.load_config` and then only read. Values arrive as strings from
``serving.properties`` and the environment; the ``before`` validators here turn LMI's spellings
(``true``/``false``, ``"128,256"``, ``float16``) into typed values, and pydantic's constraints reject
what is out of range. The loader maps pydantic's errors back to the LMI key, value and source.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from neuron_lmi.config.dtypes import canonical_dtype
from neuron_lmi.config.speculative import (
    SpeculativeConfig,
    json_value,
    lmi_draft_model,
    parse_speculative_config,
)

DEFAULT_MODEL = "smollm2"  # the built-in model every command and engine serves when none is named

# What --backend asks for, and what LMI's option.rolling_batch asks for: the one table that the
# configuration's types, the command line and dispatch (neuron_lmi.backends.dispatch) all read.
BACKEND_REQUESTS = ("auto", "cpu", "neuron", "vllm")
# "disable" keeps continuous batching on (the only mode here) and lets the host decide; "cpu" is
# this project's own; TensorRT-LLM has no equivalent here.
ROLLING_BATCH_REQUESTS: Mapping[str, str] = MappingProxyType(
    {
        "auto": "auto",
        "disable": "auto",
        "scheduler": "auto",
        "vllm": "vllm",
        "lmi-dist": "vllm",
        "tnx": "neuron",
        "neuronx": "neuron",
        "cpu": "cpu",
    }
)

Dtype = Literal["fp32", "bf16", "fp16"]
RollingBatch = Literal[tuple(ROLLING_BATCH_REQUESTS)]  # type: ignore[valid-type]
GroupQueryAttention = Literal["shard-over-heads", "shard-over-batch", "replicated-heads", "all-gather-heads"]
Backend = Literal[BACKEND_REQUESTS]  # type: ignore[valid-type]
Engine = Literal["Python", "MPI"]
# LMI's option.quantize: static_int8 (transformers-neuronx), int8/int4 weight-only (NxD Inference,
# CPU), fp8 (NxD Inference on trn2).
Quantize = Literal["static_int8", "int8", "int4", "fp8"]
ModelLoader = Literal["nxdi", "tnx", "vllm"]
# The Neuron chip families NxD Inference targets (NEURON_PLATFORM_TARGET_OVERRIDE's values).
NEURON_PLATFORMS = ("inf2", "trn1", "trn2", "trn3")
NeuronPlatform = Literal[NEURON_PLATFORMS]  # type: ignore[valid-type]
# Tuned NeuronConfig sets (neuron_lmi.backends.nxdi.defaults.PROFILES).
NXDI_PROFILES = ("trn2-tuned",)
NxdiProfile = Literal[NXDI_PROFILES]  # type: ignore[valid-type]
# vLLM's names for the tool-call formats neuron_lmi.server.tool_parsers reads.
ToolCallParser = Literal["hermes", "llama3_json", "mistral"]
# vLLM's names for the reasoning formats neuron_lmi.server.reasoning splits off.
ReasoningParser = Literal["deepseek_r1", "qwen3"]


# Fallback when the model's max_position_embeddings is unknown; LMI's smart default caps at 4096.
N_POSITIONS_FALLBACK = 2048
N_POSITIONS_CAP = 4096
# Batching defaults, here once: the configuration's fields read them, and the CPU engine's options
# (neuron_lmi.backends.cpu.engine.CpuEngineOptions) are made from the resolved configuration.
DEFAULT_MAX_ROLLING_BATCH_SIZE = 32
DEFAULT_MAX_QUEUE_SIZE = 1000
# option.max_prefill_tokens unset: how many prompt tokens one step of our engine prefills at most
# (None stays None in the configuration, so vLLM keeps its own default).
DEFAULT_MAX_PREFILL_TOKENS = 4096
# neuron-lmi generate runs one prompt: one KV row where no source sets option.max_rolling_batch_size
# (or option.batch_size), instead of the server's DEFAULT_MAX_ROLLING_BATCH_SIZE rows.
GENERATE_MAX_ROLLING_BATCH_SIZE = 1


class ConfigError(ValueError):
    """A configuration value that cannot be used: names the key, the value and where it came from.

    ``key`` is the name as the user wrote it (``option.tensor_parallel_degree``,
    ``OPTION_TENSOR_PARALLEL_DEGREE``, ``--tensor-parallel-degree``...), ``source`` one of the labels
    used in ``ResolvedConfig.sources``.
    """

    def __init__(self, key: str, value: object, source: str, reason: str) -> None:
        self.key = key
        self.value = value
        self.source = source
        self.reason = reason
        super().__init__(f"{key}={value!r} (from {source}): {reason}")


def default_n_positions(max_position_embeddings: int | None) -> int:
    """LMI's smart default: ``min(max_position_embeddings, 4096)``, or 2048 when the model is unknown.

    The one rule for every backend and model source (local folder, built-in, ``s3://``, Hub, GGUF),
    applied once the model's own limit can be read: by the loader for a local folder, by each
    builder (or the CPU engine, which reads GGUF headers too) after the fetch."""
    if max_position_embeddings is None or max_position_embeddings <= 0:
        return N_POSITIONS_FALLBACK
    return min(int(max_position_embeddings), N_POSITIONS_CAP)


def default_n_positions_source(max_position_embeddings: int | None) -> str:
    """How :func:`default_n_positions` found its value, as ``ResolvedConfig.sources`` labels it."""
    if max_position_embeddings is None or max_position_embeddings <= 0:
        return f"default:{N_POSITIONS_FALLBACK}"
    return f"default:min(max_position_embeddings={max_position_embeddings}, {N_POSITIONS_CAP})"


def _parse_bool(value: Any) -> Any:
    """``true/false/1/0/yes/no/on/off`` in any case; anything else is left for pydantic to reject."""
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
    return value


def _strip(value: Any) -> Any:
    return value.strip() if isinstance(value, str) else value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=False)

    def given(self, name: str) -> bool:
        """Whether a source (CLI, serving.properties, environment) set field ``name``; False where
        it holds its default, so a backend can apply its own (NxD Inference: the checkpoint's dtype)."""
        return name in self.model_fields_set

    @field_validator("*", mode="before")
    @classmethod
    def _lax_strings(cls, value: Any, info: Any) -> Any:
        """Strip whitespace, and read LMI's boolean spellings for boolean fields."""
        value = _strip(value)
        field = cls.model_fields[info.field_name]
        if field.annotation is bool:
            return _parse_bool(value)
        return value


class ModelOptions(_Section):
    """Which checkpoint to serve and how to load it.

    ``model_id`` is a built-in name, a local directory or ``.gguf`` file, an ``s3://`` URI or a Hub id;
    None only until the SageMaker model directory fills it in.
    """

    model_id: str | None = None
    revision: str | None = None
    dtype: Dtype = "fp16"
    trust_remote_code: bool = False
    model_loading_timeout: float = Field(default=1800.0, gt=0, le=7 * 24 * 3600)
    # vLLM's (and LMI's) switch off compiled graphs: the CPU engine then decodes eagerly too.
    enforce_eager: bool = False

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        if isinstance(value, str):
            return canonical_dtype(value) or value
        return value

    @field_validator("model_id", "revision")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("must not be empty")
        return value


class BatchingOptions(_Section):
    """Rolling (continuous) batching and the static shapes the model is compiled for.

    Invariants: every context-length estimate is positive, strictly increasing, and at most
    ``n_positions`` when that is set. ``batch_size`` None means "the rolling batch size" when rolling
    batch is on and 1 otherwise (see :attr:`effective_batch_size`).
    """

    rolling_batch: RollingBatch = "auto"
    max_rolling_batch_size: int = Field(default=DEFAULT_MAX_ROLLING_BATCH_SIZE, ge=1, le=4096)
    batch_size: int | None = Field(default=None, ge=1, le=4096)
    n_positions: int | None = Field(default=None, ge=1, le=1 << 20)
    context_length_estimate: tuple[int, ...] | None = None
    max_queue_size: int = Field(default=DEFAULT_MAX_QUEUE_SIZE, ge=1)
    max_prefill_tokens: int | None = Field(default=None, ge=1)
    # vLLM's speculative_config (JSON, vLLM's names): n-gram prompt lookup or a draft model on the
    # CPU engine (docs/speculative-decoding.md); None decodes one token per step.
    speculative_config: SpeculativeConfig | None = None
    # LMI's draft-model keys: the same draft_model setting (``speculation``); one or the other.
    speculative_draft_model: str | None = None
    speculative_length: int | None = Field(default=None, ge=1)

    @field_validator("speculative_config", mode="plain")
    @classmethod
    def _speculative(cls, value: Any) -> SpeculativeConfig | None:
        return parse_speculative_config(value)

    @field_validator("rolling_batch", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("context_length_estimate", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            parts = [p.strip() for p in value.strip().strip("[]").split(",")]
            return [p for p in parts if p]
        return value

    @field_validator("context_length_estimate")
    @classmethod
    def _increasing(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("needs at least one length")
        if any(v <= 0 for v in value):
            raise ValueError("lengths must be positive")
        if list(value) != sorted(set(value)):
            raise ValueError("lengths must be strictly increasing")
        return value

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """The speculative-decoding setting, from ``speculative_config`` or LMI's draft-model keys
        (the loader refuses both at once)."""
        if self.speculative_draft_model is not None:
            return lmi_draft_model(self.speculative_draft_model, self.speculative_length)
        return self.speculative_config

    @property
    def rolling(self) -> bool:
        """Whether requests join and leave a running batch."""
        return self.rolling_batch != "disable"

    @property
    def effective_batch_size(self) -> int:
        """The compiled batch: the rolling batch size unless batch_size says otherwise."""
        if self.batch_size is not None:
            return self.batch_size
        return self.max_rolling_batch_size if self.rolling else 1


class ParallelOptions(_Section):
    """Tensor parallelism: ``tensor_parallel_degree`` is a positive int or ``"max"`` (all visible cores).

    ``group_query_attention`` None leaves the choice to the backend (shard-over-heads on Neuron).
    """

    tensor_parallel_degree: int | Literal["max"] = 1
    group_query_attention: GroupQueryAttention | None = None

    @field_validator("tensor_parallel_degree", mode="before")
    @classmethod
    def _int_or_max(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip().lower()
            if text == "max":
                return "max"
            if text.lstrip("+-").isdigit():
                return int(text)
            raise ValueError("must be a positive integer or 'max'")
        return value

    @field_validator("tensor_parallel_degree")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 1024:
            raise ValueError("must be between 1 and 1024, or 'max'")
        return value

    @field_validator("group_query_attention", mode="before")
    @classmethod
    def _gqa_spelling(cls, value: Any) -> Any:
        return value.strip().lower().replace("_", "-") if isinstance(value, str) else value


class NeuronOptions(_Section):
    """Neuron compile settings (NxD Inference and transformers-neuronx); ignored by CPU and CUDA vLLM.

    ``model_loader`` is LMI's ``option.model_loader`` (nxdi|tnx|vllm): which Neuron library serves;
    None lets dispatch pick what imports. ``override_neuron_config`` is a JSON object merged last into
    NxD Inference's ``NeuronConfig`` keyword arguments (and vllm-neuron's ``override_neuron_config``).
    ``on_device_sampling`` (on by default, as AWS serves NxD Inference) draws each row's token on the
    device from its own temperature, top-k and top-p; rows that need more (log-probabilities,
    penalties, logit_bias, a grammar, a seed) are sampled on the host from the logits that come back
    beside the tokens (docs/configuration.md). ``neuron_platform`` names the
    chip NxD Inference targets (None: NEURON_PLATFORM_TARGET_OVERRIDE, else the instance type);
    ``allow_unsupported_nxdi_on_inf2_trn1`` lets NxD Inference 0.9+ start on inf2/trn1 (refused by
    default: AWS ended inf2/trn1 support at 0.8, SDK 2.28); ``nxdi_profile`` selects a tuned set.
    """

    model_loader: ModelLoader | None = None
    override_neuron_config: dict[str, Any] | None = None
    on_device_sampling: bool = True
    save_sharded_checkpoint: bool = False
    logical_nc_config: int | None = Field(default=None, ge=1, le=2)
    compiled_graph_path: str | None = None
    save_mp_checkpoint_path: str | None = None
    neuron_optimize_level: int | None = Field(default=None, ge=1, le=3)
    enable_saturate_infinity: bool = False
    enable_mixed_precision_accumulation: bool = False
    quantize: Quantize | None = None
    fuse_qkv: bool = False
    neuron_platform: NeuronPlatform | None = None
    allow_unsupported_nxdi_on_inf2_trn1: bool = False
    nxdi_profile: NxdiProfile | None = None

    @property
    def nxdi_on_cpu(self) -> bool:
        """``override_neuron_config.on_cpu``: NxD Inference's own modeling code on the CPU."""
        return (self.override_neuron_config or {}).get("on_cpu") is True

    @field_validator("model_loader", "neuron_platform", "nxdi_profile", mode="before")
    @classmethod
    def _loader_lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("override_neuron_config", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = json_value(value)
            if not isinstance(value, dict):
                raise ValueError("must be a JSON object (a mapping of NeuronConfig fields)")
        return value


class BackendOptions(_Section):
    """Which engine runs the model. ``engine`` is LMI's ``engine=`` line (``Python`` or ``MPI``)."""

    backend: Backend = "auto"
    engine: Engine = "Python"

    @field_validator("backend", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_case(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"python": "Python", "mpi": "MPI"}.get(value.strip().lower(), value)
        return value


class ServerOptions(_Section):
    """The HTTP front end. ``api_key`` is a SecretStr: it never appears in reprs, logs or print-config."""

    host: str = "0.0.0.0"
    port: int = Field(default=8080, ge=0, le=65535)
    api_key: SecretStr | None = None
    max_body_bytes: int = Field(default=6 * 1024 * 1024, ge=1024)
    fail_fast: bool = False
    grace_period_s: float = Field(default=30.0, ge=0, le=3600)
    sagemaker: bool = False
    # Tool calling: the output format to parse (vLLM's names; None: read from the chat template). Set
    # on a model whose chat template has no tool support, it also turns on the built-in tool prompt.
    tool_call_parser: ToolCallParser | None = None
    enable_auto_tool_choice: bool = True
    # Reasoning output: the thinking is split off into message.reasoning (vLLM's names; None: none).
    reasoning_parser: ReasoningParser | None = None


# LMI on vLLM (djl-serving's LmiConfigRecommender): 256 rolling-batch rows where none is set.
VLLM_DEFAULT_MAX_ROLLING_BATCH_SIZE = 256
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


class VllmOptions(_Section):
    """vLLM's own settings under LMI's names, read by the vLLM backends (CUDA, vLLM's CPU build,
    vllm-neuron); the CPU and Neuron engines ignore them, as CUDA vLLM ignores ``NeuronOptions``.

    ``chat_template`` is a Jinja template, inline or a path to a file; ``served_model_name`` None
    names the model by ``model_id``. Every other ``option.<AsyncEngineArgs field>`` reaches vLLM
    through ``ResolvedConfig.vllm_options`` instead, typed by vLLM's own annotations.
    """

    gpu_memory_utilization: float = Field(default=VLLM_DEFAULT_GPU_MEMORY_UTILIZATION, gt=0, le=1)
    chat_template: str | None = None
    seed: int = 0
    served_model_name: str | None = None


class LoraOptions(_Section):
    """LoRA adapters served beside the base model (LMI's and vLLM's names; the CPU engine).

    ``lora_modules``: vLLM's ``--lora-modules`` as ``(name, path)`` pairs, given as ``name=path``
    words (spaces or commas between them) or a JSON list of ``{"name", "path"}`` objects; adapters in
    the model directory's ``adapters/`` folder are served too (LMI's layout). ``max_cpu_loras`` None:
    ``max_loras``; ``max_cpu_loras >= max_loras`` (the loader checks it, naming the key to change).
    """

    enable_lora: bool = False
    max_loras: int = Field(default=4, ge=1, le=256)
    max_lora_rank: int = Field(default=16, ge=1, le=1024)
    max_cpu_loras: int | None = Field(default=None, ge=1)
    lora_modules: tuple[tuple[str, str], ...] = ()

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else [w for w in re.split(r"[\s,]+", text) if w]
        if isinstance(value, list | tuple):
            return [_lora_module(item) for item in value]
        return value

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def _lora_module(item: Any) -> Any:
    """One ``--lora-modules`` entry as (name, path): ``name=path`` or ``{"name", "path"}``."""
    if isinstance(item, dict):
        return (item.get("name"), item.get("path"))
    if isinstance(item, str):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules entry {item!r} is not name=path")
        return (name.strip(), path.strip())
    return item


class ServingConfig(BaseModel):
    """Everything ``neuron-lmi serve`` needs, split by concern. Frozen; build it with ``load_config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ModelOptions = ModelOptions()
    batching: BatchingOptions = BatchingOptions()
    parallel: ParallelOptions = ParallelOptions()
    neuron: NeuronOptions = NeuronOptions()
    backend: BackendOptions = BackendOptions()
    server: ServerOptions = ServerOptions()
    vllm: VllmOptions = VllmOptions()
    lora: LoraOptions = LoraOptions()


SECTIONS: dict[str, type[_Section]] = {
    "model": ModelOptions,
    "batching": BatchingOptions,
    "parallel": ParallelOptions,
    "neuron": NeuronOptions,
    "backend": BackendOptions,
    "server": ServerOptions,
    "vllm": VllmOptions,
    "lora": LoraOptions,
}
