"""Model hyper-parameters read from a Hugging Face config, independent of the transformers version."""

from __future__ import annotations

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


# Families whose attention honours ``config.sliding_window`` (Llama configs carry none).
SLIDING_WINDOW_MODEL_TYPES = frozenset({"mistral", "mixtral"})
SLIDING_WINDOW_ARCHITECTURES = frozenset({"MistralForCausalLM", "MixtralForCausalLM"})


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A sparse mixture of experts: ``n_experts`` SwiGLU experts (each of the model's
    ``intermediate_size``), ``top_k`` of them per token. Invariant: ``1 <= top_k <= n_experts``."""

    n_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if self.n_experts < 1:
            raise ValueError(f"model config: num_local_experts must be positive, got {self.n_experts!r}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(
                f"model config: num_experts_per_tok must be in [1, num_local_experts={self.n_experts}], "
                f"got {self.top_k!r}"
            )


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """Everything the torch Llama/Mistral/Mixtral implementation needs; validated on construction.

    ``moe`` is ``None`` for a dense MLP; with experts, ``intermediate_size`` is each expert's.
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
    """Build ``ModelArgs`` from a ``PretrainedConfig`` or its dict form."""
    architectures = _get(config, "architectures") or []
    architecture = architectures[0] if architectures else f"{_get(config, 'model_type', '?')}"
    n_heads = int(_get(config, "num_attention_heads"))
    hidden = int(_get(config, "hidden_size"))
    head_dim = _get(config, "head_dim") or hidden // n_heads
    model_type = _get(config, "model_type")
    windowed = model_type in SLIDING_WINDOW_MODEL_TYPES or architecture in SLIDING_WINDOW_ARCHITECTURES
    sliding = _get(config, "sliding_window") if windowed else None
    return ModelArgs(
        architecture=architecture,
        vocab_size=int(_get(config, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_get(config, "intermediate_size")),
        n_layers=int(_get(config, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(_get(config, "num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        max_position_embeddings=int(_get(config, "max_position_embeddings", 2048)),
        rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        rope=_rope_spec(config),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        sliding_window=int(sliding) if sliding else None,
        attention_bias=bool(_get(config, "attention_bias", False)),
        mlp_bias=bool(_get(config, "mlp_bias", False)),
        bos_token_id=_get(config, "bos_token_id"),
        eos_token_ids=_eos_ids(config),
        moe=_moe_spec(config),
    )


def _moe_spec(config: Any) -> MoeSpec | None:
    n_experts = _get(config, "num_local_experts")
    if n_experts is None:
        return None
    return MoeSpec(n_experts=int(n_experts), top_k=int(_get(config, "num_experts_per_tok", 2)))
