"""From our configuration to NxD Inference's constructor arguments: one pure mapping, no Neuron import.

    ServingConfig + config.json --plan_nxdi--> NxdiPlan
        .application        Neuron{Llama,Mistral,Mixtral,Qwen2,Qwen3,Qwen3Moe,Gemma3}ForCausalLM
                            (``applications``: by model_type and release)
        .inference_config   its XInferenceConfig
        .neuron_config_cls  NeuronConfig | MoENeuronConfig (Mixtral, Qwen3-MoE)
        .neuron_config      the exact keyword arguments (JSON; ``torch_dtype`` by name, see ``kwargs()``)
        .ignored            LMI keys NxD Inference does not take, and config.json fields the
                            application does not honour (``model_checks``), each with the reason

The table (our field -> NeuronConfig keyword) holds for aws-neuron/neuronx-distributed-inference 0.8.0
(cd3abf3, Neuron SDK 2.28, the last release for inf2/trn1) and 0.9.0 (4bcdc54, SDK 2.29, Trn2+):
``models/config.py`` takes the same keywords in both (0.9 adds ``enable_ve_data_parallel``). Where the
releases differ, the version decides: 0.8 has no Mistral application, so a Mistral runs on NxD
Inference's Llama (which reads ``sliding_window`` as its Mistral does); its Mixtral has no sliding
window in either release; 0.8's Qwen3 keeps q/k/v apart; Gemma 3 starts at 0.9. Qwen2, Qwen3 and
Qwen3-MoE (every expert setting is read by the application from config.json: num_experts,
num_experts_per_tok, moe_intermediate_size; MoENeuronConfig's defaults hold) and Gemma 3 take the same
keywords as Llama. Checked against the library itself on the CPU (``tests/backends/nxdi_library``)::

    tensor_parallel_degree        tp_degree
    max_rolling_batch_size        batch_size, max_batch_size, tkg_batch_size (and ctx_batch_size=1)
    (continuous batching)         is_continuous_batching=True, padding_side="right"
    n_positions                   seq_len, max_context_length (a prompt may fill the sequence)
    dtype                         torch_dtype (a torch dtype object; NxD refuses "bf16"); unset:
                                  the checkpoint's torch_dtype, as AWS's vLLM loader does
    context_length_estimate       context_encoding_buckets (+ n_positions, so no prompt is ever
                                  fed one token at a time); enable_bucketing=True
    (n_positions)                 token_generation_buckets: 128, 256, ... n_positions
    fuse_qkv                      fused_qkv; unset: on where the application fuses the weights
    quantize int8|fp8             quantized, quantization_dtype int8|f8e4m3, per_channel_symmetric
    logical_nc_config             logical_nc_config (2 on trn2)
    nxdi_profile=trn2-tuned       the kernels and layout of AWS's tuned trn2 set (``defaults``)
    save_sharded_checkpoint       save_sharded_checkpoint
    on_device_sampling (default)  on_device_sampling_config={dynamic, do_sample, deterministic=False,
                                  global_topk=256} and output_logits=True: per-row top_k/top_p/
                                  temperature drawn on the device, logits kept for host sampling
                                  (``NxdiRunner``, ``engine.device_sampling``); false: logits only
    override_neuron_config        merged last, every key kept; keys NeuronConfig does not know are
                                  reported (NxD only logs "Unexpected keyword arguments" and goes on)
    override on_cpu=true          NxD Inference's modeling code on the CPU (``to_cpu``): one rank, one
                                  bucket (n_positions), no fp16, no compile-cache entry; refused for
                                  an application the CPU mode cannot run (Qwen3-MoE)
    speculative_config            draft_model / eagle / eagle3: fused speculation, speculation_length
                                  = num_speculative_tokens + 1 and the draft's own NeuronConfig
                                  (``speculation``); ngram refused
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from compile_cache import architecture_config
from compile_cache.key import token_generation_buckets
from neuron_lmi.backends.nxdi import defaults
from neuron_lmi.backends.nxdi.applications import (
    APPLICATIONS,
    APPLICATIONS_0_8,
    CONFIG_MODULE,
    HF_ADAPTER_MODULE,
    LIBRARY,
    Application,
)
from neuron_lmi.backends.nxdi.fields import (
    LOCATION_FIELDS,
    NEURON_CONFIG_FIELDS,
    NEURON_CONFIG_FIELDS_0_8,
    NOT_TAKEN,
    NOT_TAKEN_DEFAULTS,
)
from neuron_lmi.backends.nxdi.lora import NxdiLora, plan_lora
from neuron_lmi.backends.nxdi.model_checks import sliding_window, text_config
from neuron_lmi.backends.nxdi.speculation import FusedSpeculation, check_overrides, plan_speculation
from neuron_lmi.backends.nxdi.support import (
    DEFAULT_VERSION,
    Platform,
    check_release,
    library_release,
    release,
)
from neuron_lmi.config.dtypes import DTYPES

if TYPE_CHECKING:
    from neuron_lmi.config.options import ServingConfig
    from neuron_lmi.runners.base import DeviceSampling

MIN_BUCKET = 128
DEFAULT_GLOBAL_TOPK = 256  # OnDeviceSamplingConfig's global_topk default (models/config.py)
ON_DEVICE_SAMPLING: Mapping[str, Any] = MappingProxyType(
    {"dynamic": True, "do_sample": True, "deterministic": False, "global_topk": DEFAULT_GLOBAL_TOPK}
)
TORCH_DTYPES = MappingProxyType({d.name: d.torch_name for d in DTYPES.values()})
DTYPE_NAMES = MappingProxyType({torch_name: name for name, torch_name in TORCH_DTYPES.items()})
# option.quantize -> NxD Inference's weight quantization dtype; static_int8 is LMI's tnx spelling.
QUANTIZATION_DTYPES = MappingProxyType({"int8": "int8", "static_int8": "int8", "fp8": "f8e4m3"})


@dataclass(frozen=True, slots=True)
class NxdiPlan:
    """Everything the NxD Inference backend will construct, as plain data.

    Invariants: ``neuron_config`` holds JSON values only (``torch_dtype`` by NxD's dtype name);
    ``context_buckets[-1] == token_buckets[-1] == n_positions``; ``batch_size`` is the number of KV-cache
    rows (continuous batching); ``ignored`` maps a key to the reason it has no effect.
    """

    model_path: str
    model_type: str
    application: Application
    neuron_config: dict[str, Any]
    n_positions: int
    batch_size: int
    tp_degree: int
    dtype: str
    context_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    on_device_sampling: bool = False
    ignored: dict[str, str] = field(default_factory=dict)
    library_version: str = DEFAULT_VERSION["other"]
    version_source: str = "assumed"
    on_cpu: bool = False
    sliding_window: int | None = None  # the ring the application keeps, when it keeps one
    vocab_size: int = 0  # the language model's (a vision-language config states it in text_config)
    platform: str | None = None
    platform_source: str = ""
    dtype_source: str = "option.dtype"
    profile: str | None = None
    environment: dict[str, str] = field(default_factory=dict)  # set before compile or load
    warnings: tuple[str, ...] = ()  # logged at start-up
    speculation: FusedSpeculation | None = None  # the draft fused into the token-generation graph
    lora: NxdiLora | None = None  # the adapters compiled in (lora_config)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments exactly as passed: ``torch_dtype`` as the torch dtype object."""
        import torch

        out = dict(self.neuron_config)
        out["torch_dtype"] = getattr(torch, out["torch_dtype"])
        return out

    def device_sampling(self) -> DeviceSampling | None:
        """What the application's sampler does, read from the final keyword arguments (overrides
        included): ``dynamic`` or ``do_sample`` draw per row (``modules/generation/sampling.py``
        ``Sampler.forward``), else argmax only; rows draw from at most ``global_topk`` tokens."""
        from neuron_lmi.runners.base import DeviceSampling  # torch: not for a dry run's plan

        config = self.neuron_config.get("on_device_sampling_config")
        if config is None:
            return None
        per_line = bool(config.get("dynamic") or config.get("do_sample"))
        top_k = int(config.get("global_topk", DEFAULT_GLOBAL_TOPK)) if per_line else 1
        return DeviceSampling(per_line, top_k, bool(self.neuron_config.get("output_logits")))

    def key_args(self) -> dict[str, Any]:
        """What the compile-cache key hashes besides the shared fields: classes and every argument."""
        return {
            "library": LIBRARY,
            "application": self.application.path(self.application.application),
            "inference_config": self.application.path(self.application.inference_config),
            "neuron_config_cls": f"{CONFIG_MODULE}.{self.application.neuron_config_cls}",
            "neuron_config": {k: v for k, v in self.neuron_config.items() if k not in LOCATION_FIELDS},
            **({"speculation": _speculation_key(self.speculation)} if self.speculation else {}),
            **({"lora": _lora_key(self.lora)} if self.lora else {}),
        }

    def describe(self) -> dict[str, Any]:
        """The dry-run view: classes, the exact keyword arguments, buckets and what is ignored."""
        shown = dict(self.neuron_config)
        shown["torch_dtype"] = f"torch.{shown['torch_dtype']}"
        return {
            "library": LIBRARY,
            "library_version": self.library_version,
            "library_version_source": self.version_source,
            "platform": self.platform,
            "platform_source": self.platform_source,
            "dtype": self.dtype,
            "dtype_source": self.dtype_source,
            "profile": self.profile,
            **({"profile_left_out": dict(defaults.PROFILE_LEFT_OUT)} if self.profile else {}),
            "environment": dict(self.environment),
            "warnings": list(self.warnings),
            "on_cpu": self.on_cpu,
            "application_class": self.application.path(self.application.application),
            "inference_config_class": self.application.path(self.application.inference_config),
            "inference_config_load_config": (
                f"{HF_ADAPTER_MODULE}.load_pretrained_config({self.model_path!r})"
            ),
            "neuron_config_class": f"{CONFIG_MODULE}.{self.application.neuron_config_cls}",
            "neuron_config_kwargs": shown,
            "context_encoding_buckets": list(self.context_buckets),
            "token_generation_buckets": list(self.token_buckets),
            "ignored": dict(self.ignored),
            "speculation": self.speculation.describe() if self.speculation is not None else None,
            "lora_config": dict(self.lora.kwargs) if self.lora is not None else None,
        }


def _speculation_key(spec: FusedSpeculation) -> dict[str, Any]:
    """The draft's part of the compile-cache key: its keywords and architecture, not its folder."""
    shown = spec.describe()
    shown.pop("draft_model_path")
    return {**shown, "draft_architecture": architecture_config(spec.draft_config)}


def _lora_key(lora: NxdiLora) -> dict[str, Any]:
    """The adapters' part of the key: the serving config and the names in order, not the folders."""
    return {**{k: v for k, v in lora.kwargs.items() if k != "lora_ckpt_paths"}, "names": list(lora.names)}


def nxdi_context_buckets(n_positions: int, estimate: tuple[int, ...] | None) -> tuple[int, ...]:
    """``context_length_estimate`` plus ``n_positions``, else powers of two from 128 to ``n_positions``.

    NxD Inference picks the smallest bucket longer than the prompt, or the largest when the prompt
    fills it (``model_wrapper._get_seq_bucket``); ending at ``n_positions`` means every prompt that fits
    the sequence is context-encoded in one call.
    """
    if estimate:
        bad = [e for e in estimate if e < 1 or e > n_positions]
        if bad:
            raise ValueError(f"context_length_estimate {bad} outside 1..n_positions={n_positions}")
        return tuple(sorted({*estimate, n_positions}))
    return token_generation_buckets(n_positions, MIN_BUCKET)


def resolve_tp(config: ServingConfig, tp_degree: int | None) -> int:
    tp = config.parallel.tensor_parallel_degree
    if tp == "max":
        if tp_degree is None:
            raise ValueError("tensor_parallel_degree=max needs the number of visible NeuronCores")
        return int(tp_degree)
    return int(tp)


def _quantization(quantize: str | None) -> dict[str, Any]:
    if quantize is None:
        return {}
    if quantize not in QUANTIZATION_DTYPES:
        raise ValueError(
            f"option.quantize={quantize!r}: NxD Inference quantizes weights to "
            f"{', '.join(sorted(QUANTIZATION_DTYPES))}; int4 is not supported there"
        )
    return {
        "quantized": True,
        "quantization_dtype": QUANTIZATION_DTYPES[quantize],
        "quantization_type": "per_channel_symmetric",
        # Filled in with a folder inside the compile-cache entry at compile time (a location, not a key).
        "quantized_checkpoints_path": "<artifacts>/quantized",
    }


def _ignored(config: ServingConfig, fields: frozenset[str], version: str) -> dict[str, str]:
    values = {
        "group_query_attention": config.parallel.group_query_attention,
        "neuron_optimize_level": config.neuron.neuron_optimize_level,
        "enable_saturate_infinity": config.neuron.enable_saturate_infinity,
        "enable_mixed_precision_accumulation": config.neuron.enable_mixed_precision_accumulation,
        "batch_size": config.batching.batch_size,
    }
    out = {f"option.{k}": NOT_TAKEN[k] for k, v in values.items() if v != NOT_TAKEN_DEFAULTS[k]}
    for key in sorted(set(config.neuron.override_neuron_config or {}) - fields):
        out[f"override_neuron_config.{key}"] = (
            f"not a NeuronConfig field in NxD Inference {version} (the library would drop it silently)"
        )
    return out


def _on_cpu(kwargs: dict[str, Any], dtype: str, dtype_source: str, application: Application) -> None:
    """``to_cpu`` runs one process per rank under torchrun, fp32 only with tp > 1, never fp16
    (application_base.py ``to_cpu``); the server runs one process, so tp must be 1. An application
    whose forward needs a device (``Application.no_cpu_mode``) is refused."""
    if application.no_cpu_mode:
        raise ValueError(
            f"override_neuron_config.on_cpu=true: NxD Inference's {application.application} cannot run "
            f"on the CPU: {application.no_cpu_mode}; check this model on a Neuron device"
        )
    if kwargs["tp_degree"] != 1:
        raise ValueError(
            f"override_neuron_config.on_cpu=true runs NxD Inference in this one process: "
            f"option.tensor_parallel_degree={kwargs['tp_degree']} needs torchrun with one process per "
            "rank; set option.tensor_parallel_degree=1"
        )
    if dtype == "fp16":
        given = "option.dtype=fp16" if dtype_source == "option.dtype" else f"fp16 ({dtype_source})"
        raise ValueError(
            f"override_neuron_config.on_cpu=true: NxD Inference refuses {given} on the CPU; set "
            "option.dtype=fp32 or bf16"
        )
    # In on_cpu mode the modules are built for the largest bucket only (application_base.to_cpu with
    # model_base masks): any smaller bucket fails with a shape mismatch.
    kwargs["context_encoding_buckets"] = kwargs["token_generation_buckets"] = [kwargs["seq_len"]]


def _base_kwargs(config: ServingConfig, tp: int, dtype: str, application: Application) -> dict[str, Any]:
    batching, neuron = config.batching, config.neuron
    n_positions, rows = int(batching.n_positions or 0), batching.max_rolling_batch_size
    return {
        "tp_degree": tp,
        "batch_size": rows,
        "max_batch_size": rows,
        "tkg_batch_size": rows,
        "ctx_batch_size": 1,
        "is_continuous_batching": True,
        "seq_len": n_positions,
        "max_context_length": n_positions,
        "torch_dtype": TORCH_DTYPES[dtype],
        "enable_bucketing": True,
        "context_encoding_buckets": list(nxdi_context_buckets(n_positions, batching.context_length_estimate)),
        "token_generation_buckets": list(token_generation_buckets(n_positions, MIN_BUCKET)),
        "fused_qkv": defaults.fused_qkv(config, application),
        "padding_side": "right",
        "save_sharded_checkpoint": neuron.save_sharded_checkpoint,
        **_quantization(neuron.quantize),
    }


def _key(name: str, config: ServingConfig, profile: Mapping[str, Any], option: str | None = None) -> str:
    """The key that decided keyword ``name``: the override, the option, else the profile."""
    neuron = config.neuron
    overrides = neuron.override_neuron_config or {}
    if name in overrides:
        return f"override_neuron_config.{name}={overrides[name]!r}"
    if option is not None and neuron.given(option):
        return f"option.{option}={getattr(neuron, option)!r}"
    if name in profile:
        return f"{defaults.PROFILE_KEY}={neuron.nxdi_profile}"
    return f"option.{option or name}"


def _neuron_kwargs(
    config: ServingConfig, tp: int, dtype: str, application: Application, platform: Platform
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(keyword arguments, the profile's): base, then the profile, then explicit options, then
    ``override_neuron_config`` last."""
    neuron = config.neuron
    overrides = neuron.override_neuron_config or {}
    kwargs = _base_kwargs(config, tp, dtype, application)
    profile = defaults.profile_kwargs(neuron.nxdi_profile, platform, overrides.get("on_cpu") is True, dtype)
    kwargs.update(profile)
    if neuron.given("fuse_qkv"):
        kwargs["fused_qkv"] = neuron.fuse_qkv
    if neuron.logical_nc_config is not None:
        kwargs["logical_nc_config"] = neuron.logical_nc_config
    if neuron.on_device_sampling:
        # AWS's serving default (vLLM's NxD Inference loader: dynamic, not deterministic), each row
        # drawing from its own sampling_params; logits still come back for the rows the host samples.
        kwargs["on_device_sampling_config"] = dict(ON_DEVICE_SAMPLING)
        kwargs["output_logits"] = True
    kwargs.update(overrides)
    return kwargs, profile


def plan_nxdi(
    config: ServingConfig,
    model_config: Mapping[str, Any],
    model_path: str,
    tp_degree: int | None = None,
    library_version: str | None = None,
    platform: str | Platform | None = None,
    version_source: str = "installed",
) -> NxdiPlan:
    """The NxD Inference plan for ``config`` and the model's ``config.json`` (no Neuron import), for
    ``library_version`` (given or installed, as ``version_source`` says; None: the one ``platform``
    runs). Raises ``ValueError`` naming the key, ``UnsupportedReleaseError`` where the SDK matrix rules
    it out."""
    model_type = str(model_config.get("model_type", ""))
    if isinstance(platform, Platform):
        target = platform
    else:
        target = Platform(platform, "given") if platform else Platform(None, "platform unknown")
    version, version_source = library_release(library_version, target, model_type, version_source)
    old = (release(version) or (0, 9)) <= (0, 8)
    neuron = config.neuron
    warning = check_release(version, target.name, model_type, neuron.allow_unsupported_nxdi_on_inf2_trn1)
    applications = APPLICATIONS_0_8 if old else APPLICATIONS
    application = applications.get(model_type)
    if application is None:
        raise ValueError(
            f"config.json model_type={model_type!r} has no NxD Inference application here; "
            f"supported: {', '.join(sorted(applications))}"
        )
    if config.batching.n_positions is None:
        raise ValueError(
            "n_positions is not set; apply the model defaults (config.apply_model_defaults) first"
        )
    dtype, dtype_source = defaults.resolve_dtype(config, model_config)
    kwargs, profile = _neuron_kwargs(config, resolve_tp(config, tp_degree), dtype, application, target)
    on_cpu = kwargs.get("on_cpu") is True
    if on_cpu:
        _on_cpu(kwargs, dtype, dtype_source, application)
    _check(kwargs)
    defaults.check_fused_qkv(kwargs, application, version, _key("fused_qkv", config, profile, "fuse_qkv"))
    defaults.check_sequence_parallel(kwargs, _key("sequence_parallel_enabled", config, profile))
    where = f"NxD Inference {version}'s {application.application}"
    window, window_ignored = sliding_window(
        application.windows, model_config, int(kwargs["seq_len"]), on_cpu, where
    )
    check_overrides(config.neuron.override_neuron_config)
    speculation = plan_speculation(
        config.batching.speculation,
        kwargs,
        model_config,
        lambda draft_type: applications.get(draft_type) == application,
        window,
    )
    lora = plan_lora(config.lora, Path(model_path), int(kwargs["max_batch_size"]), base_model_index=not old)
    ignored = _ignored(config, NEURON_CONFIG_FIELDS_0_8 if old else NEURON_CONFIG_FIELDS, version)
    ignored.update(application.check(model_config, version))
    ignored.update(window_ignored)
    return NxdiPlan(
        model_path=model_path,
        model_type=model_type,
        application=application,
        neuron_config=kwargs,
        n_positions=int(kwargs["seq_len"]),
        batch_size=int(kwargs["max_batch_size"]),
        tp_degree=int(kwargs["tp_degree"]),
        dtype=DTYPE_NAMES[kwargs["torch_dtype"]],
        context_buckets=tuple(kwargs["context_encoding_buckets"]),
        token_buckets=tuple(kwargs["token_generation_buckets"]),
        on_device_sampling=kwargs.get("on_device_sampling_config") is not None,
        ignored=ignored,
        library_version=version,
        version_source=version_source,
        on_cpu=on_cpu,
        sliding_window=window,
        vocab_size=int(text_config(model_config).get("vocab_size") or 0),
        platform=target.name,
        platform_source=target.source,
        dtype_source=dtype_source if kwargs["torch_dtype"] == TORCH_DTYPES[dtype] else "override",
        profile=neuron.nxdi_profile,
        environment=defaults.special_scalar_environment(kwargs),
        warnings=(warning,) if warning else (),
        speculation=speculation,
        lora=lora,
    )


def _check(kwargs: Mapping[str, Any]) -> None:
    """NxD Inference's own asserts (config.py 139, 192–200), raised here with the key's name."""
    if kwargs["torch_dtype"] not in TORCH_DTYPES.values():
        raise ValueError(f"override_neuron_config.torch_dtype={kwargs['torch_dtype']!r}: use a torch name")
    if kwargs["max_context_length"] > kwargs["seq_len"]:
        raise ValueError(
            f"max_context_length={kwargs['max_context_length']} exceeds seq_len={kwargs['seq_len']}"
        )
    if kwargs["context_encoding_buckets"][-1] > kwargs["max_context_length"]:
        raise ValueError("context_encoding_buckets must not exceed max_context_length")
    if kwargs["token_generation_buckets"][-1] > kwargs["seq_len"]:
        raise ValueError("token_generation_buckets must not exceed seq_len")
    if kwargs["ctx_batch_size"] != 1 and kwargs["is_continuous_batching"]:
        raise ValueError("continuous batching writes one prompt per context call: ctx_batch_size must be 1")
