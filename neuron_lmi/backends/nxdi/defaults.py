"""AWS's own NxD Inference serving defaults and tuned set: what the plan starts from where a key is unset.

    key unset                 our default                          AWS's source
    option.dtype              the checkpoint's torch_dtype         vLLM-NxDI loader: dtype "auto" is the
                              (bf16 where config.json names none)  checkpoint's; every example is bf16
    option.fuse_qkv           on where the application's weight    the tuned configs
                              conversion fuses Q/K/V, else off     (card_llama33_70b.yml), optimum-neuron
    fp8 weights or a          XLA_HANDLE_SPECIAL_SCALAR=1 in the   developer_guides/feature-guide.rst
    quantized KV cache        environment (unless already set)
    option.nxdi_profile       trn2-tuned: the 70B card's kernels   card_llama33_70b.yml config1/config2,
                              and layout (below)                   tutorials/trn2-llama3.3-70b-tutorial

Every keyword stays overridable: ``override_neuron_config`` is merged after all of this.

Fused QKV, as the libraries convert weights (0.8.0 cd3abf3, 0.9.0 4bcdc54): the Llama, Qwen2 and
Qwen3-MoE applications (both releases) and 0.9's Qwen3 and Gemma 3 concatenate q/k/v into ``Wqkv``
under ``fused_qkv`` (``Application.fuses_qkv``); 0.9's ``NeuronMistralForCausalLM``, 0.8's Qwen3 and
both releases' Mixtral keep separate q/k/v weights. A Mistral on 0.8 runs on the Llama application, so
it fuses there and not on 0.9.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from neuron_lmi.backends.nxdi.support import NKI_RISK, Platform
from neuron_lmi.config.dtypes import canonical_dtype

if TYPE_CHECKING:
    from neuron_lmi.backends.nxdi.applications import Application
    from neuron_lmi.config.options import ServingConfig

log = logging.getLogger(__name__)

FALLBACK_DTYPE = "bf16"  # NxD Inference's examples and kernels: bf16
PROFILE_KEY = "option.nxdi_profile"
SPECIAL_SCALAR = "XLA_HANDLE_SPECIAL_SCALAR"

# The Llama-3.3-70B card's trn2 configurations (config1 latency, config2 throughput) less what is
# named in PROFILE_LEFT_OUT; tp, batch and buckets stay the deployment's own keys.
TRN2_TUNED: Mapping[str, Any] = MappingProxyType(
    {
        "fused_qkv": True,
        "sequence_parallel_enabled": True,
        "qkv_kernel_enabled": True,
        "mlp_kernel_enabled": True,
        "attn_kernel_enabled": True,
        "attn_block_tkg_nki_kernel_enabled": True,
        "attn_block_tkg_nki_kernel_cache_update": True,
        "k_cache_transposed": True,
        "cc_pipeline_tiling_factor": 1,
        "logical_nc_config": 2,
    }
)
PROFILES: Mapping[str, Mapping[str, Any]] = MappingProxyType({"trn2-tuned": TRN2_TUNED})
PROFILE_LEFT_OUT: Mapping[str, str] = MappingProxyType(
    {
        "async_mode": "needs on-device sampling and a runner that overlaps steps; NxdiRunner waits for "
        "each step's output",
        "on_device_sampling_config": "on by default for every target (option.on_device_sampling: "
        "dynamic, per-row sampling_params, output_logits for host-sampled rows), not a profile key",
        "kv_cache_tiling": "not a NeuronConfig keyword (the library derives it and drops the card's key); "
        "attn_block_tkg_nki_kernel_cache_update already turns it off",
    }
)


def checkpoint_dtype(model_config: Mapping[str, Any]) -> tuple[str, str] | None:
    """(our dtype name, the raw value) from ``config.json``'s ``torch_dtype`` (``dtype`` in
    transformers 5), or None where it names none we serve."""
    for key in ("torch_dtype", "dtype"):
        raw = model_config.get(key)
        name = canonical_dtype(raw) if isinstance(raw, str) else None
        if name is not None:
            return name, f"{key}={raw}"
    return None


def resolve_dtype(config: ServingConfig, model_config: Mapping[str, Any]) -> tuple[str, str]:
    """(dtype, where it came from): ``option.dtype`` where set, else the checkpoint's, else bf16.
    (LMI's transformers-neuronx default was fp16; see docs/configuration.md.)"""
    if config.model.given("dtype"):
        return config.model.dtype, "option.dtype"
    found = checkpoint_dtype(model_config)
    if found is not None:
        return found[0], f"config.json {found[1]} (option.dtype unset)"
    return FALLBACK_DTYPE, f"default {FALLBACK_DTYPE}: option.dtype unset and config.json names no dtype"


def fused_qkv(config: ServingConfig, application: Application) -> bool:
    """``option.fuse_qkv`` where set, else on exactly where the application fuses the weights."""
    if config.neuron.given("fuse_qkv"):
        return config.neuron.fuse_qkv
    return application.fuses_qkv


def check_fused_qkv(kwargs: Mapping[str, Any], application: Application, version: str, key: str) -> None:
    """Refuse ``fused_qkv`` where the application's weight conversion keeps q/k/v apart: its fused
    projection would find no weights to load."""
    if kwargs.get("fused_qkv") and not application.fuses_qkv:
        raise ValueError(
            f"{key}: NxD Inference {version}'s {application.application} does not fuse Q/K/V weights "
            "when it converts the checkpoint; leave fused_qkv off"
        )


def profile_kwargs(name: str | None, platform: Platform, on_cpu: bool, dtype: str) -> dict[str, Any]:
    """The tuned set ``option.nxdi_profile`` names ({} for None). Raises ``ValueError`` naming the key
    on inf2/trn1 (NKI kernels), in the CPU mode, or off bf16 (the QKV/MLP kernels need bf16)."""
    if name is None:
        return {}
    if name not in PROFILES:
        raise ValueError(f"{PROFILE_KEY}={name!r}: expected one of {', '.join(PROFILES)}")
    where = f"{PROFILE_KEY}={name}"
    if platform.v2:
        raise ValueError(
            f"{where} selects NKI kernels (QKV, MLP, attention, token-generation attention block), and "
            f"the platform is {platform.describe()}: {NKI_RISK}; drop {PROFILE_KEY} on inf2/trn1"
        )
    if on_cpu:
        raise ValueError(
            f"{where} selects NKI kernels, which run on a NeuronCore; check the configuration with "
            "override_neuron_config.on_cpu without the profile"
        )
    if dtype != "bf16":
        raise ValueError(
            f"{where}: its QKV and MLP kernels need bf16 weights, and the dtype is {dtype}; set "
            "option.dtype=bf16 (or leave it unset for a bf16 checkpoint)"
        )
    return dict(PROFILES[name])


def check_sequence_parallel(kwargs: Mapping[str, Any], key: str) -> None:
    """Sequence parallelism splits every context bucket over the tp ranks: each must divide evenly."""
    if not kwargs.get("sequence_parallel_enabled"):
        return
    tp = int(kwargs["tp_degree"])
    bad = [b for b in kwargs["context_encoding_buckets"] if b % tp]
    if bad:
        raise ValueError(
            f"{key}: sequence parallelism splits each context bucket over the {tp} ranks, and "
            f"context bucket(s) {bad} are not multiples of tensor_parallel_degree={tp}; set "
            f"option.context_length_estimate and option.n_positions to multiples of {tp}"
        )


def special_scalar_environment(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """``XLA_HANDLE_SPECIAL_SCALAR=1`` where the weights are fp8 or the KV cache is quantized (NxD
    Inference's feature guide; its own ``inference_demo`` sets it on the same condition)."""
    fp8 = bool(kwargs.get("quantized")) and str(kwargs.get("quantization_dtype", "")).startswith("f8")
    kv = bool(kwargs.get("kv_cache_quant")) or kwargs.get("kv_quant_config") is not None
    return {SPECIAL_SCALAR: "1"} if fp8 or kv else {}


def apply_environment(wanted: Mapping[str, str], env: MutableMapping[str, str]) -> None:
    """Set what the plan needs in ``env`` (the process environment, before the library compiles or
    loads); a value the user already set is kept, with a warning where it differs."""
    for name, value in wanted.items():
        current = env.get(name)
        if current is None:
            env[name] = value
            log.info("NxD Inference: %s=%s (fp8 weights or a quantized KV cache need it)", name, value)
        elif current != value:
            log.warning(
                "NxD Inference: %s=%s is kept as set; fp8 weights or a quantized KV cache need %s",
                name,
                current,
                value,
            )
