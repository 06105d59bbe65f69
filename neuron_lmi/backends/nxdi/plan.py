"""From our configuration to NxD Inference's constructor arguments: one pure mapping, no Neuron import.

    ServingConfig + config.json --plan_nxdi--> NxdiPlan
        .application        NeuronLlamaForCausalLM | NeuronMistralForCausalLM | NeuronMixtralForCausalLM
        .inference_config   LlamaInferenceConfig | MistralInferenceConfig | MixtralInferenceConfig
        .neuron_config_cls  NeuronConfig | MoENeuronConfig (Mixtral)
        .neuron_config      the exact keyword arguments (JSON; ``torch_dtype`` by name, see ``kwargs()``)
        .ignored            LMI keys NxD Inference does not take, each with the reason

The table (our field -> NeuronConfig keyword) holds for aws-neuron/neuronx-distributed-inference 0.8.0
(cd3abf3, Neuron SDK 2.28, the last release for inf2/trn1) and 0.9.0 (4bcdc54, SDK 2.29, Trn2+):
``models/config.py`` takes the same keywords in both (0.9 adds ``enable_ve_data_parallel``). Where the
releases differ, the version decides: 0.8 has no Mistral application, so a Mistral runs on NxD
Inference's Llama (which reads ``sliding_window`` as its Mistral does); its Mixtral has no sliding
window in either release. Checked against the library itself on the CPU
(``tests/backends/nxdi_library``)::

    tensor_parallel_degree        tp_degree
    max_rolling_batch_size        batch_size, max_batch_size, tkg_batch_size (and ctx_batch_size=1)
    (continuous batching)         is_continuous_batching=True, padding_side="right"
    n_positions                   seq_len, max_context_length (a prompt may fill the sequence)
    dtype                         torch_dtype (a torch dtype object; NxD refuses "bf16")
    context_length_estimate       context_encoding_buckets (+ n_positions, so no prompt is ever
                                  fed one token at a time); enable_bucketing=True
    (n_positions)                 token_generation_buckets: 128, 256, ... n_positions
    fuse_qkv                      fused_qkv
    quantize int8|fp8             quantized, quantization_dtype int8|f8e4m3, per_channel_symmetric
    logical_nc_config             logical_nc_config (2 on trn2)
    save_sharded_checkpoint       save_sharded_checkpoint
    on_device_sampling            on_device_sampling_config (greedy on device), else logits to the host
    override_neuron_config        merged last, every key kept; keys NeuronConfig does not know are
                                  reported (NxD only logs "Unexpected keyword arguments" and goes on)
    override on_cpu=true          NxD Inference's modeling code on the CPU (``to_cpu``): one rank, one
                                  bucket (n_positions), no fp16, no compile-cache entry
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from compile_cache.key import token_generation_buckets
from neuron_lmi.backends.nxdi.support import ENDS_AT_0_8, V2_PLATFORMS, check_release, release

if TYPE_CHECKING:
    from neuron_lmi.config.options import ServingConfig

LIBRARY = "neuronx-distributed-inference"
LIBRARY_MODULE = "neuronx_distributed_inference"
CONFIG_MODULE = f"{LIBRARY_MODULE}.models.config"
HF_ADAPTER_MODULE = f"{LIBRARY_MODULE}.utils.hf_adapter"
MIN_BUCKET = 128
TORCH_DTYPES = MappingProxyType({"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"})
# option.quantize -> NxD Inference's weight quantization dtype; static_int8 is LMI's tnx spelling.
QUANTIZATION_DTYPES = MappingProxyType({"int8": "int8", "static_int8": "int8", "fp8": "f8e4m3"})


@dataclass(frozen=True, slots=True)
class Application:
    """One NxD Inference causal-LM application: its module and the three classes built from it."""

    module: str
    application: str
    inference_config: str
    neuron_config_cls: str

    def path(self, name: str) -> str:
        return f"{self.module}.{name}"


LLAMA = Application(
    f"{LIBRARY_MODULE}.models.llama.modeling_llama",
    "NeuronLlamaForCausalLM",
    "LlamaInferenceConfig",
    "NeuronConfig",
)
MISTRAL = Application(
    f"{LIBRARY_MODULE}.models.mistral.modeling_mistral",
    "NeuronMistralForCausalLM",
    "MistralInferenceConfig",
    "NeuronConfig",
)
MIXTRAL = Application(
    f"{LIBRARY_MODULE}.models.mixtral.modeling_mixtral",
    "NeuronMixtralForCausalLM",
    "MixtralInferenceConfig",
    "MoENeuronConfig",
)
# config.json model_type -> application (NxD Inference's utils/constants.py MODEL_TYPES), per release:
# 0.8 has no models/mistral, so a Mistral runs on the Llama application (same weights and layers).
APPLICATIONS: Mapping[str, Application] = MappingProxyType(
    {"llama": LLAMA, "mistral": MISTRAL, "mixtral": MIXTRAL}
)
APPLICATIONS_0_8: Mapping[str, Application] = MappingProxyType({**APPLICATIONS, "mistral": LLAMA})
# Applications whose attention reads config.sliding_window (a ring cache of that many slots).
WINDOWED_APPLICATIONS = frozenset({LLAMA.application, MISTRAL.application})
DEFAULT_VERSION = {"v2": "0.8.0", "other": "0.9.0"}  # assumed where the library is not installed


# NeuronConfig / MoENeuronConfig / OnDeviceSamplingConfig keyword arguments read by ``kwargs.pop`` in
# models/config.py at 4bcdc54. Anything else in override_neuron_config is silently dropped by the
# library, so it is named at start-up instead.
NEURON_CONFIG_FIELDS = frozenset(
    """batch_size padding_side allow_input_truncation seq_len n_active_tokens n_positions on_cpu
    output_logits torch_dtype overrides_torch_dtype cast_type rpl_reduce_dtype attention_dtype
    max_context_length max_new_tokens max_length vocab_parallel enable_cte_modular_flow
    layer_boundary_markers fused_qkv sequence_parallel_enabled weight_gather_seq_len_threshold attn_cls
    ctx_batch_size tkg_batch_size max_batch_size is_continuous_batching kv_cache_batch_size
    kv_cache_padding_size on_device_sampling_config disable_argmax_kernel async_mode enable_bucketing
    buckets bucket_n_active_tokens context_encoding_buckets prefix_buckets token_generation_buckets
    token_generation_batches quantized quantized_checkpoints_path quantization_type quantization_dtype
    quantization_block_size quantization_block_axis quantization_scale_dtype is_mxfp4_compute
    is_full_model_shuffled modules_to_not_convert kv_cache_quant speculation_length spec_batch_size
    enable_fused_speculation enable_eagle_speculation eagle_rolling_buffer_kernel_enabled is_eagle3
    is_eagle_draft enable_eagle_draft_input_norm token_tree_config is_medusa medusa_speculation_length
    num_medusa_heads medusa_tree is_block_kv_layout pa_num_blocks pa_block_size is_prefix_caching
    windowed_context_encoding_size chunked_prefill_config kv_quant_config tensor_replacement_config
    tensor_capture_config lora_config tp_degree cp_degree mlp_cp_degree attention_dp_degree pp_degree
    ep_degree save_sharded_checkpoint skip_sharding enable_ve_data_parallel qk_layernorm pre_rope_rmsnorm
    world_size start_rank_id local_ranks_size flash_decoding_enabled disable_kv_cache_tiling
    k_cache_transposed attn_kernel_enabled strided_context_parallel_kernel_enabled qkv_kernel_enabled
    qkv_nki_kernel_enabled qkv_cte_nki_kernel_fuse_rope qkv_kernel_nbsd_layout mlp_kernel_enabled
    mlp_tkg_nki_kernel_enabled fused_rmsnorm_skip_gamma mlp_kernel_fuse_residual_add
    qkv_kernel_fuse_residual_add quantized_mlp_kernel_enabled out_proj_kernel_enabled
    activation_quantization_type attn_tkg_nki_kernel_enabled attn_tkg_builtin_kernel_enabled
    attn_block_tkg_nki_kernel_enabled attn_block_tkg_nki_kernel_cache_update
    attn_block_tkg_nki_kernel_cascaded_attention attn_block_tkg_nki_kernel_use_online_softmax
    attn_block_tkg_nki_kernel_disable_gpsimd_sb2sb attn_block_cte_nki_kernel_enabled
    rmsnorm_quantize_kernel_enabled quantize_clamp_bound moe_fused_nki_kernel_enabled
    router_topk_nki_kernel_enabled expert_mlp_nki_kernel_enabled shared_mlp_nki_kernel_enabled
    lm_head_pad lm_head_pad_alignment_size cc_pipeline_tiling_factor seq_len_threshold_for_cc_tiling
    target enable_spill_reload_dge weights_to_skip_layout_optimization dma_order_config
    apply_seq_ids_mask skip_warmup scratchpad_page_size padded_hidden_size padded_intermediate_size
    switch_cc ep_dispatch_cc_option logical_neuron_cores logical_nc_config skip_vision
    capacity_factor glu_mlp glu_type hidden_act_scaling_factor hidden_act_bias gate_clamp_upper_limit
    gate_clamp_lower_limit up_clamp_upper_limit up_clamp_lower_limit use_index_calc_kernel
    moe_mask_padded_tokens early_expert_affinity_modulation disable_normalize_top_k_affinities
    fused_shared_experts shared_experts_sequence_parallel_enabled return_expert_index
    return_router_logits hybrid_sharding_config moe_tp_degree moe_ep_degree
    transpose_shared_experts_weights blockwise_matmul_config router_config""".split()  # noqa: SIM905
)
# 0.8.0 (cd3abf3) takes the same keywords but one.
NEURON_CONFIG_FIELDS_0_8 = NEURON_CONFIG_FIELDS - {"enable_ve_data_parallel"}
# Keys that say where files go, not what is compiled: kept out of the cache key.
LOCATION_FIELDS = frozenset({"quantized_checkpoints_path"})
# LMI keys the NxD Inference backend does not take, and why (reported once at start-up).
NOT_TAKEN: Mapping[str, str] = MappingProxyType(
    {
        "group_query_attention": "NxD Inference chooses GQA sharding itself (KV heads replicated up to "
        "tp_degree, or converted to MHA when tp % kv_heads != 0)",
        "neuron_optimize_level": "NxD Inference builds its own compiler arguments (get_compiler_args); "
        "set them through override_neuron_config where the application exposes them",
        "enable_saturate_infinity": "a transformers-neuronx compiler flag",
        "enable_mixed_precision_accumulation": "a transformers-neuronx compiler flag",
        "batch_size": "continuous batching compiles max_rolling_batch_size rows (ctx_batch_size=1)",
    }
)
_NOT_TAKEN_DEFAULTS: Mapping[str, Any] = MappingProxyType(
    {
        "group_query_attention": None,
        "neuron_optimize_level": None,
        "enable_saturate_infinity": False,
        "enable_mixed_precision_accumulation": False,
        "batch_size": None,
    }
)


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

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments exactly as passed: ``torch_dtype`` as the torch dtype object."""
        import torch

        out = dict(self.neuron_config)
        out["torch_dtype"] = getattr(torch, out["torch_dtype"])
        return out

    def key_args(self) -> dict[str, Any]:
        """What the compile-cache key hashes besides the shared fields: classes and every argument."""
        return {
            "library": LIBRARY,
            "application": self.application.path(self.application.application),
            "inference_config": self.application.path(self.application.inference_config),
            "neuron_config_cls": f"{CONFIG_MODULE}.{self.application.neuron_config_cls}",
            "neuron_config": {k: v for k, v in self.neuron_config.items() if k not in LOCATION_FIELDS},
        }

    def describe(self) -> dict[str, Any]:
        """The dry-run view: classes, the exact keyword arguments, buckets and what is ignored."""
        shown = dict(self.neuron_config)
        shown["torch_dtype"] = f"torch.{shown['torch_dtype']}"
        return {
            "library": LIBRARY,
            "library_version": self.library_version,
            "library_version_source": self.version_source,
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
        }


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
    out = {f"option.{k}": NOT_TAKEN[k] for k, v in values.items() if v != _NOT_TAKEN_DEFAULTS[k]}
    for key in sorted(set(config.neuron.override_neuron_config or {}) - fields):
        out[f"override_neuron_config.{key}"] = (
            f"not a NeuronConfig field in NxD Inference {version} (the library would drop it silently)"
        )
    return out


def library_release(version: str | None, platform: str | None, model_type: str) -> tuple[str, str]:
    """The release the mapping is for and how it was found: the installed one, else the one that
    serves this model on this platform (0.8 on inf2/trn1 and for Mixtral, 0.9 elsewhere)."""
    if version:
        return version, "installed"
    family = (platform or "").rstrip("n")
    if family in V2_PLATFORMS:
        return DEFAULT_VERSION["v2"], f"assumed: not installed, the release for {platform}"
    if model_type in ENDS_AT_0_8:
        return DEFAULT_VERSION["v2"], f"assumed: not installed, the last release with {model_type}"
    where = f"for {platform}" if platform else "platform unknown"
    return DEFAULT_VERSION["other"], f"assumed: not installed, {where}"


def _window(application: Application, model_config: Mapping[str, Any], n_positions: int) -> int | None:
    window = model_config.get("sliding_window")
    if not isinstance(window, int) or window <= 0 or window >= n_positions:
        return None
    return window


def _on_cpu(kwargs: dict[str, Any], dtype: str) -> None:
    """``to_cpu`` runs one process per rank under torchrun, fp32 only with tp > 1, never fp16
    (application_base.py ``to_cpu``); the server runs one process, so tp must be 1."""
    if kwargs["tp_degree"] != 1:
        raise ValueError(
            f"override_neuron_config.on_cpu=true runs NxD Inference in this one process: "
            f"option.tensor_parallel_degree={kwargs['tp_degree']} needs torchrun with one process per "
            "rank; set option.tensor_parallel_degree=1"
        )
    if dtype == "fp16":
        raise ValueError(
            "override_neuron_config.on_cpu=true: NxD Inference refuses option.dtype=fp16 on the CPU"
        )
    # In on_cpu mode the modules are built for the largest bucket only (application_base.to_cpu with
    # model_base masks): any smaller bucket fails with a shape mismatch.
    kwargs["context_encoding_buckets"] = kwargs["token_generation_buckets"] = [kwargs["seq_len"]]


def plan_nxdi(
    config: ServingConfig,
    model_config: Mapping[str, Any],
    model_path: str,
    tp_degree: int | None = None,
    library_version: str | None = None,
    platform: str | None = None,
) -> NxdiPlan:
    """The NxD Inference plan for ``config`` and the model's ``config.json`` (no Neuron import), for
    ``library_version`` (the installed release; None: the one ``platform`` runs). Raises
    ``ValueError`` naming the key, ``UnsupportedReleaseError`` where the SDK matrix rules it out."""
    model_type = str(model_config.get("model_type", ""))
    version, version_source = library_release(library_version, platform, model_type)
    old = (release(version) or (0, 9)) <= (0, 8)
    applications = APPLICATIONS_0_8 if old else APPLICATIONS
    application = applications.get(model_type)
    if application is None:
        raise ValueError(
            f"config.json model_type={model_type!r} has no NxD Inference application here; "
            f"supported: {', '.join(sorted(applications))}"
        )
    check_release(version, platform, model_type)
    batching, neuron = config.batching, config.neuron
    if batching.n_positions is None:
        raise ValueError(
            "n_positions is not set; apply the model defaults (config.apply_model_defaults) first"
        )
    n_positions, rows, tp = (
        batching.n_positions,
        batching.max_rolling_batch_size,
        resolve_tp(config, tp_degree),
    )
    context = nxdi_context_buckets(n_positions, batching.context_length_estimate)
    tokens = token_generation_buckets(n_positions, MIN_BUCKET)
    kwargs: dict[str, Any] = {
        "tp_degree": tp,
        "batch_size": rows,
        "max_batch_size": rows,
        "tkg_batch_size": rows,
        "ctx_batch_size": 1,
        "is_continuous_batching": True,
        "seq_len": n_positions,
        "max_context_length": n_positions,
        "torch_dtype": TORCH_DTYPES[config.model.dtype],
        "enable_bucketing": True,
        "context_encoding_buckets": list(context),
        "token_generation_buckets": list(tokens),
        "fused_qkv": neuron.fuse_qkv,
        "padding_side": "right",
        "save_sharded_checkpoint": neuron.save_sharded_checkpoint,
        **_quantization(neuron.quantize),
    }
    if neuron.logical_nc_config is not None:
        kwargs["logical_nc_config"] = neuron.logical_nc_config
    if neuron.on_device_sampling:
        # Greedy on the device; only the chosen token comes back (see NxdiRunner).
        kwargs["on_device_sampling_config"] = {"do_sample": False, "top_k": 1, "dynamic": False}
    kwargs.update(neuron.override_neuron_config or {})
    on_cpu = kwargs.get("on_cpu") is True
    if on_cpu:
        _on_cpu(kwargs, config.model.dtype)
    _check(kwargs)
    window = _window(application, model_config, int(kwargs["seq_len"]))
    ignored = _ignored(config, NEURON_CONFIG_FIELDS_0_8 if old else NEURON_CONFIG_FIELDS, version)
    if window is not None and application.application not in WINDOWED_APPLICATIONS:
        ignored["config.json sliding_window"] = (
            f"NxD Inference {version}'s {application.application} has no sliding window: with "
            f"n_positions={kwargs['seq_len']} > sliding_window={window}, tokens past the first {window} "
            f"attend to the whole sequence, not the last {window} as the model was trained; set "
            f"option.n_positions <= {window} to stay within the window"
        )
    return NxdiPlan(
        model_path=model_path,
        model_type=model_type,
        application=application,
        neuron_config=kwargs,
        n_positions=int(kwargs["seq_len"]),
        batch_size=int(kwargs["max_batch_size"]),
        tp_degree=int(kwargs["tp_degree"]),
        dtype=config.model.dtype,
        context_buckets=tuple(kwargs["context_encoding_buckets"]),
        token_buckets=tuple(kwargs["token_generation_buckets"]),
        on_device_sampling=kwargs.get("on_device_sampling_config") is not None,
        ignored=ignored,
        library_version=version,
        version_source=version_source,
        on_cpu=on_cpu,
        sliding_window=window if application.application in WINDOWED_APPLICATIONS else None,
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
