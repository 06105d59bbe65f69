"""Model hyper-parameters read from a Hugging Face config, independent of the transformers version."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding parameters. ``kind`` is one of default, linear, dynamic, llama3, yarn."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None


# Families whose attention honours ``config.sliding_window`` in every layer (Llama configs carry
# none; Qwen3-MoE's config clears it unless ``use_sliding_window``). Families with per-layer windows
# say so through ``layer_types`` (``_layer_windows``).
SLIDING_WINDOW_MODEL_TYPES = frozenset({"mistral", "mixtral", "qwen3_moe"})
SLIDING_WINDOW_ARCHITECTURES = frozenset({"MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"})
LAYER_TYPES_MODEL_TYPES = frozenset({"qwen2", "qwen3", "gemma3_text", "gemma3"})
# transformers' Gemma3ForConditionalGeneration never caps its logits, whatever its text_config's
# final_logit_softcapping says (Gemma3ForCausalLM does); served text-only, it computes the same.
UNCAPPED_LOGITS_ARCHITECTURES = frozenset({"Gemma3ForConditionalGeneration"})


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A sparse mixture of experts: ``n_experts`` SwiGLU experts (each of ``intermediate_size``, or
    the model's when None), ``top_k`` of them per token, their softmax weights renormalised to sum 1
    when ``normalize`` (Mixtral always; Qwen3-MoE when ``norm_topk_prob``). Layers in
    ``dense_layers`` keep a dense MLP of the model's ``intermediate_size`` (Qwen3-MoE's
    ``mlp_only_layers``/``decoder_sparse_step``). Invariant: ``1 <= top_k <= n_experts``."""

    n_experts: int
    top_k: int
    intermediate_size: int | None = None
    normalize: bool = True
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.n_experts < 1:
            raise ValueError(f"model config: num_local_experts must be positive, got {self.n_experts!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"model config: num_experts_per_tok must be in [1, num_local_experts={self.n_experts}], "
                f"got {self.top_k!r}"
            )


HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Everything the torch Llama implementation needs for every family it serves (Llama, Mistral,
    Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma 3); validated on construction.

    ``moe`` is ``None`` for a dense MLP; with experts, each is of ``moe.intermediate_size`` (or
    ``intermediate_size`` when that is None, as for Mixtral).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeSpec
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    moe: MoeSpec | None = None
    # Per-family variations of the Llama block, all off for Llama/Mistral/Mixtral:
    qkv_bias: bool = False  # q/k/v projections carry a bias, o does not (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's q and k before rotary (Qwen3, Gemma 3)
    # One window per layer (None: full attention) where layers differ; empty: ``sliding_window``
    # for every layer.
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeSpec | None = None  # the windowed layers' rotary where it differs (Gemma 3)
    attn_scale: float | None = None  # softmax scale when not head_dim**-0.5 (Gemma 3)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    final_softcap: float | None = None  # logits capped as cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads", "n_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads={self.n_heads} is not a multiple of "
                f"num_key_value_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        if self.layer_windows and len(self.layer_windows) != self.n_layers:
            raise ValueError(
                f"model config: {len(self.layer_windows)} layer types for {self.n_layers} layers"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(
                f"model config: unsupported hidden_act {self.hidden_act!r}; supported: {HIDDEN_ACTS}"
            )

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None: it attends over every earlier position)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _rope_spec(config: Any) -> RopeSpec:
    # transformers 4.x: rope_theta + rope_scaling; 5.x: rope_parameters holding both.
    params = dict(_get(config, "rope_parameters") or {})
    scaling = dict(_get(config, "rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", _get(config, "rope_theta", 10000.0)))
    kind = str(merged.get("rope_type", merged.get("type", "default")))
    if kind not in {"default", "linear", "dynamic", "llama3", "yarn"}:
        raise ValueError(f"model config: unsupported rope scaling type {kind!r}")
    return RopeSpec(
        theta=theta,
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        attention_factor=merged.get("attention_factor"),
    )


def _eos_ids(config: Any) -> tuple[int, ...]:
    eos = _get(config, "eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def model_args_from_config(config: Any) -> ModelArgs:
    """Build ``ModelArgs`` from a ``PretrainedConfig`` or its dict form (a multimodal config's
    ``text_config`` for its language model)."""
    architectures = _get(config, "architectures") or []
    architecture = architectures[0] if architectures else f"{_get(config, 'model_type', '?')}"
    config = _text_config(config)
    n_heads = int(_get(config, "num_attention_heads"))
    hidden = int(_get(config, "hidden_size"))
    head_dim = _get(config, "head_dim") or hidden // n_heads
    model_type = _get(config, "model_type")
    n_layers = int(_get(config, "num_hidden_layers"))
    windowed = model_type in SLIDING_WINDOW_MODEL_TYPES or architecture in SLIDING_WINDOW_ARCHITECTURES
    sliding = _get(config, "sliding_window") if windowed else None
    if model_type == "qwen3_moe" and not _get(config, "use_sliding_window", False):
        sliding = None  # the dict form keeps the value the config class clears
    family: dict[str, Any] = {
        "hidden_act": str(_get(config, "hidden_act") or "silu"),
        "sliding_window": int(sliding) if sliding else None,
    }
    family |= FAMILY_FIELDS.get(model_type, _no_fields)(config)
    if architecture in UNCAPPED_LOGITS_ARCHITECTURES:
        family["final_softcap"] = None
    if model_type in LAYER_TYPES_MODEL_TYPES:
        family |= _layer_windows(config, model_type, n_layers)
    return ModelArgs(
        architecture=architecture,
        vocab_size=int(_get(config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_get(config, "intermediate_size")),
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=int(_get(config, "num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(_get(config, "max_position_embeddings", 2048)),
        rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        rope=_rope_spec(config),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        attention_bias=bool(_get(config, "attention_bias", False)),
        mlp_bias=bool(_get(config, "mlp_bias", False)),
        bos_token_id=_get(config, "bos_token_id"),
        eos_token_ids=_eos_ids(config),
        moe=_moe_spec(config, model_type, n_layers),
        **family,
    )


def _text_config(config: Any) -> Any:
    """A multimodal config's language model (Gemma 3: ``text_config``), else ``config`` itself."""
    text = _get(config, "text_config")
    if text is None or _get(config, "hidden_size") is not None:
        return config
    return text


def _no_fields(config: Any) -> dict[str, Any]:
    return {}


def _qwen2_fields(config: Any) -> dict[str, Any]:
    return {"qkv_bias": True}


def _qwen3_fields(config: Any) -> dict[str, Any]:
    return {"qk_norm": True}


def _gemma3_fields(config: Any) -> dict[str, Any]:
    if _get(config, "use_bidirectional_attention", False):
        raise ValueError("model config: use_bidirectional_attention (an encoder Gemma) is not supported")
    hidden = int(_get(config, "hidden_size"))
    scalar = _get(config, "query_pre_attn_scalar")
    return {
        "qk_norm": True,
        "attn_scale": float(scalar) ** -0.5 if scalar else None,
        "embed_scale": hidden**0.5,
        "hidden_act": str(_get(config, "hidden_activation") or "gelu_pytorch_tanh"),
        # attn_logit_softcapping is not read: transformers' Gemma 3 attention never applies it
        # (eager or SDPA), and Gemma 3's released configs leave it null.
        "final_softcap": _optional_float(_get(config, "final_logit_softcapping")),
        # Local layers rotate with their own base and no scaling (rope_scaling is the global layers').
        "local_rope": RopeSpec(theta=float(_get(config, "rope_local_base_freq", 10000.0))),
    }


# model_type -> ModelArgs fields that family sets beyond the common ones.
FAMILY_FIELDS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "qwen2": _qwen2_fields,
    "qwen3": _qwen3_fields,
    "qwen3_moe": _qwen3_fields,
    "gemma3_text": _gemma3_fields,
    "gemma3": _gemma3_fields,
}


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _layer_windows(config: Any, model_type: str, n_layers: int) -> dict[str, Any]:
    """``sliding_window``/``layer_windows`` from ``layer_types``: one window for all layers when they
    agree (so the plain single-window path runs), else one per layer."""
    sliding = _get(config, "sliding_window")
    types = _get(config, "layer_types") or _default_layer_types(config, model_type, n_layers)
    if len(types) != n_layers:
        raise ValueError(f"model config: {len(types)} layer_types for num_hidden_layers={n_layers}")
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"model config: unsupported layer_types {sorted(unknown)}")
    windows = tuple(int(sliding) if t == "sliding_attention" and sliding else None for t in types)
    if len(set(windows)) == 1:
        return {"sliding_window": windows[0]}
    return {"sliding_window": None, "layer_windows": windows}


def _default_layer_types(config: Any, model_type: str, n_layers: int) -> list[str]:
    """What the config class derives when ``config.json`` lists no ``layer_types``."""
    if model_type.startswith("gemma3"):
        pattern = int(_get(config, "sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    first_full = int(_get(config, "max_window_layers", n_layers))
    windowed = bool(_get(config, "use_sliding_window", False))
    return [
        "sliding_attention" if windowed and i >= first_full else "full_attention" for i in range(n_layers)
    ]


def _moe_spec(config: Any, model_type: str | None, n_layers: int) -> MoeSpec | None:
    if model_type == "qwen3_moe":
        return _qwen3_moe_spec(config, n_layers)
    n_experts = _get(config, "num_local_experts")
    if n_experts is None:
        return None
    return MoeSpec(n_experts=int(n_experts), top_k=int(_get(config, "num_experts_per_tok", 2)))


def _qwen3_moe_spec(config: Any, n_layers: int) -> MoeSpec:
    """Experts in layer i unless i is in ``mlp_only_layers`` or (i + 1) is not a multiple of
    ``decoder_sparse_step``, as transformers' Qwen3-MoE decoder layer decides."""
    n_experts = int(_get(config, "num_experts"))
    step = int(_get(config, "decoder_sparse_step", 1) or 1)
    mlp_only = set(_get(config, "mlp_only_layers") or ())
    dense = tuple(i for i in range(n_layers) if i in mlp_only or n_experts <= 0 or (i + 1) % step)
    return MoeSpec(
        n_experts=n_experts,
        top_k=int(_get(config, "num_experts_per_tok", 8)),
        intermediate_size=int(_get(config, "moe_intermediate_size")),
        normalize=bool(_get(config, "norm_topk_prob", False)),
        dense_layers=dense,
    )
