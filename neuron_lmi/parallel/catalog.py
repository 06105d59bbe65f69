"""What the planner plans for: model architectures (presets or a ``config.json``) and Neuron instances.

Presets hold the published Hugging Face configurations (``config.json`` of meta-llama/Llama-2-7b-hf,
-13b-hf, -70b-hf and mistralai/Mistral-7B-v0.1).  Instances and their tensor-parallel degrees are
REFERENCE §6: 16 GiB of HBM per NeuronCore-v2; tp 1, 2, 4, 8, 24 on inf2 and 1, 2, 8, 32 on trn1,
limited to the instance's core count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3
HBM_PER_CORE = 16 * GIB
SUPPORTED_MODEL_TYPES = ("llama", "mistral")


def _positive(name: str, field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {field} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder's shape; ``head_dim * n_heads`` need not equal ``hidden_size`` (explicit head_dim).

    Invariants (checked on construction): every size is a positive int and ``n_heads`` is a
    multiple of ``n_kv_heads``.
    """

    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    head_dim: int = 0  # 0: hidden_size // n_heads
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for field in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "intermediate_size", "vocab_size"):
            _positive(self.name, field, getattr(self, field))
        _positive(self.name, "max_position_embeddings", self.max_position_embeddings)
        if self.head_dim == 0:
            if self.hidden_size % self.n_heads:
                raise ValueError(
                    f"{self.name}: hidden_size={self.hidden_size} is not divisible by "
                    f"num_attention_heads={self.n_heads} and no head_dim is given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        _positive(self.name, "head_dim", self.head_dim)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"{self.name}: num_attention_heads={self.n_heads} is not a multiple of "
                f"num_key_value_heads={self.n_kv_heads}"
            )

    @property
    def default_n_positions(self) -> int:
        """LMI's smart default: ``min(max_position_embeddings, 4096)``."""
        return min(self.max_position_embeddings, 4096)


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """A Neuron instance: NeuronCores, devices and the tensor-parallel degrees it supports."""

    name: str
    neuron_devices: int
    cores: int
    tp_degrees: tuple[int, ...]

    @property
    def hbm_bytes(self) -> int:
        return self.cores * HBM_PER_CORE


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        ModelSpec("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        ModelSpec("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768),
    )
}

_INF2_TP, _TRN1_TP = (1, 2, 4, 8, 24), (1, 2, 8, 32)


def _instance(name: str, devices: int, cores: int) -> InstanceSpec:
    family = _INF2_TP if name.startswith("inf2") else _TRN1_TP
    return InstanceSpec(name, devices, cores, tuple(tp for tp in family if tp <= cores))


INSTANCES: dict[str, InstanceSpec] = {
    spec.name: spec
    for spec in (
        _instance("inf2.xlarge", 1, 2),
        _instance("inf2.8xlarge", 1, 2),
        _instance("inf2.24xlarge", 6, 12),
        _instance("inf2.48xlarge", 12, 24),
        _instance("trn1.2xlarge", 1, 2),
        _instance("trn1.32xlarge", 16, 32),
    )
}


def get_instance(name: str) -> InstanceSpec:
    key = name.strip().lower().removeprefix("ml.")
    if key not in INSTANCES:
        raise ValueError(f"unknown instance {name!r}; known: {', '.join(INSTANCES)}")
    return INSTANCES[key]


def load_model_spec(ref: str) -> ModelSpec:
    """A preset name, a directory holding ``config.json``, or a ``config.json`` path."""
    key = ref.strip().lower().removeprefix("meta-llama/").removeprefix("mistralai/")
    key = key.removesuffix("-hf").removesuffix("-v0.1").replace("llama2", "llama-2")
    if key in PRESETS:
        return PRESETS[key]
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {ref!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory or config.json"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return model_spec_from_config(config, name=str(path.parent.name or path))


def model_spec_from_config(config: dict[str, Any], name: str = "model") -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face Llama/Mistral ``config.json``; ``ValueError`` names what's
    missing or inconsistent."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{name}: model_type={model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(f"{name}: config.json lacks {', '.join(missing)}")
    heads = config["num_attention_heads"]
    return ModelSpec(
        name=name,
        n_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        head_dim=config.get("head_dim") or 0,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
