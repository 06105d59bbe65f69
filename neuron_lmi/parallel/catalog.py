"""What the planner plans for: model architectures (presets or a ``config.json``) and Neuron instances.

Presets hold the published Hugging Face configurations (``config.json`` of meta-llama/Llama-2-7b-hf,
-13b-hf, -70b-hf, mistralai/Mistral-7B-v0.1, mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen2.5-7B-Instruct,
-72B-Instruct, Qwen/Qwen3-8B, -32B, -30B-A3B, -235B-A22B, google/gemma-3-12b-it and -27b-it, the
last two's ``text_config``); a MoE preset's ``intermediate_size`` is one expert's.  Instances, their
memory per NeuronCore and tensor-parallel degrees are REFERENCE §6: inf2/trn1 have 16 GiB of HBM
per NeuronCore-v2, tp 1, 2, 4, 8, 24 on inf2 and 1, 2, 8, 32 on trn1; trn2.48xlarge has 16
Trainium2 chips of 96 GiB, exposed at the default LNC=2 as 64 logical NeuronCores of 24 GiB (Neuron
docs ``arch/neuron-features/logical-neuroncore-config``, ``training/best-practices``).  NxD
Inference's Trn2 Llama-3.1-405B tutorial (aws-neuron-sdk
``libraries/nxd-inference/tutorials/trn2-llama3.1-405b-tutorial.rst``) says "with LNC=2, you can set
a TP degree up to 64"; we offer the powers of two up to 64, which divide the 64 logical cores.
Degrees are limited to the instance's core count.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_lmi.config.hf_config import read_hf_config_file
from neuron_lmi.config.options import default_n_positions

GIB = 1024**3
SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma3_text",
    "gemma3",
)
# Keys a sparse-MoE config must state (transformers' defaults would silently pick 8 and 2).
MOE_KEYS: dict[str, tuple[str, ...]] = {
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
}


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
    n_experts: int = 0  # 0: a dense MLP; else MoE experts per layer, each of intermediate_size
    experts_per_token: int = 0
    model_type: str = "llama"  # config.json's model_type: what the SDK matrix asks of a model

    def __post_init__(self) -> None:
        if self.n_experts:
            _positive(self.name, "num_local_experts", self.n_experts)
            if not 1 <= self.experts_per_token <= self.n_experts:
                raise ValueError(
                    f"{self.name}: num_experts_per_tok={self.experts_per_token!r} must be in "
                    f"[1, num_local_experts={self.n_experts}]"
                )
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
    def mlp_copies(self) -> int:
        """How many MLPs of ``intermediate_size`` a layer holds: its experts, or 1 when dense."""
        return max(self.n_experts, 1)

    @property
    def default_n_positions(self) -> int:
        """LMI's smart default, ``min(max_position_embeddings, 4096)``: the one rule serve applies."""
        return default_n_positions(self.max_position_embeddings)


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """A Neuron instance: NeuronCores (logical ones on trn2), devices, HBM per core and the
    tensor-parallel degrees it supports."""

    name: str
    neuron_devices: int
    cores: int
    tp_degrees: tuple[int, ...]
    hbm_bytes_per_core: int

    @property
    def hbm_bytes(self) -> int:
        return self.cores * self.hbm_bytes_per_core


@dataclass(frozen=True, slots=True)
class InstanceFamily:
    """What every size of a family shares: the supported tp degrees and the memory per core."""

    tp_degrees: tuple[int, ...]
    hbm_bytes_per_core: int


FAMILIES: dict[str, InstanceFamily] = {
    "inf2": InstanceFamily((1, 2, 4, 8, 24), 16 * GIB),
    "trn1": InstanceFamily((1, 2, 8, 32), 16 * GIB),
    "trn2": InstanceFamily((1, 2, 4, 8, 16, 32, 64), 24 * GIB),  # LNC=2: 2 physical cores, 96/4 GiB
}

PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
        ModelSpec("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
        ModelSpec("mistral-7b", 32, 4096, 32, 8, 14336, 32000, 32768, model_type="mistral"),
        ModelSpec(
            "mixtral-8x7b",
            32,
            4096,
            32,
            8,
            14336,
            32000,
            32768,
            n_experts=8,
            experts_per_token=2,
            model_type="mixtral",
        ),
        ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, 32768, model_type="qwen2"),
        ModelSpec("qwen2.5-72b", 80, 8192, 64, 8, 29568, 152064, 32768, model_type="qwen2"),
        ModelSpec("qwen3-8b", 36, 4096, 32, 8, 12288, 151936, 40960, head_dim=128, model_type="qwen3"),
        ModelSpec("qwen3-32b", 64, 5120, 64, 8, 25600, 151936, 40960, head_dim=128, model_type="qwen3"),
        ModelSpec(
            "qwen3-30b-a3b",
            48,
            2048,
            32,
            4,
            768,
            151936,
            40960,
            head_dim=128,
            n_experts=128,
            experts_per_token=8,
            model_type="qwen3_moe",
        ),
        ModelSpec(
            "qwen3-235b-a22b",
            94,
            4096,
            64,
            4,
            1536,
            151936,
            40960,
            head_dim=128,
            n_experts=128,
            experts_per_token=8,
            model_type="qwen3_moe",
        ),
        ModelSpec(
            "gemma-3-12b",
            48,
            3840,
            16,
            8,
            15360,
            262208,
            131072,
            head_dim=256,
            tie_word_embeddings=True,
            model_type="gemma3",
        ),
        ModelSpec(
            "gemma-3-27b",
            62,
            5376,
            32,
            16,
            21504,
            262208,
            131072,
            head_dim=128,
            tie_word_embeddings=True,
            model_type="gemma3",
        ),
    )
}


def _instance(name: str, devices: int, cores: int) -> InstanceSpec:
    family = FAMILIES[name.split(".")[0]]
    tp_degrees = tuple(tp for tp in family.tp_degrees if tp <= cores)
    return InstanceSpec(name, devices, cores, tp_degrees, family.hbm_bytes_per_core)


INSTANCES: dict[str, InstanceSpec] = {
    spec.name: spec
    for spec in (
        _instance("inf2.xlarge", 1, 2),
        _instance("inf2.8xlarge", 1, 2),
        _instance("inf2.24xlarge", 6, 12),
        _instance("inf2.48xlarge", 12, 24),
        _instance("trn1.2xlarge", 1, 2),
        _instance("trn1.32xlarge", 16, 32),
        _instance("trn2.48xlarge", 16, 64),
    )
}


def get_instance(name: str) -> InstanceSpec:
    key = name.strip().lower().removeprefix("ml.")
    if key not in INSTANCES:
        raise ValueError(f"unknown instance {name!r}; known: {', '.join(INSTANCES)}")
    return INSTANCES[key]


def load_model_spec(ref: str) -> ModelSpec:
    """A preset name, a directory holding ``config.json``, or a ``config.json`` path."""
    key = ref.strip().lower()
    for org in ("meta-llama/", "mistralai/", "qwen/", "google/"):
        key = key.removeprefix(org)
    key = key.removesuffix("-hf").removesuffix("-v0.1").removesuffix("-instruct").removesuffix("-it")
    key = key.replace("llama2", "llama-2")
    if key in PRESETS:
        return PRESETS[key]
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"--model {ref!r} is neither a preset ({', '.join(PRESETS)}) nor a model directory or config.json"
        )
    config = read_hf_config_file(path, f"--model {ref!r}")
    return model_spec_from_config(config, name=str(path.parent.name or path))


def model_spec_from_config(config: dict[str, Any], name: str = "model") -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json`` of a supported family (a vision-language
    Gemma 3's ``text_config``: the language model served); ``ValueError`` names what's missing or
    inconsistent."""
    model_type = config.get("model_type")
    if model_type == "gemma3" and isinstance(config.get("text_config"), dict):
        # Gemma ties its head to the embeddings unless a config says otherwise (Gemma3TextConfig's default).
        tied = config.get("tie_word_embeddings", True)
        config = {"tie_word_embeddings": tied, **config["text_config"], "model_type": "gemma3"}
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{name}: model_type={model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
        )
    required = (
        "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
        *MOE_KEYS.get(model_type, ()),
    )  # fmt: skip
    if model_type == "qwen3_moe":  # every expert is moe_intermediate_size wide
        required = tuple(key for key in required if key != "intermediate_size")
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(f"{name}: config.json lacks {', '.join(missing)}")
    heads = config["num_attention_heads"]
    expert_width = "moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"
    return ModelSpec(
        name=name,
        n_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        intermediate_size=config[expert_width],
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        head_dim=config.get("head_dim") or 0,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        n_experts=config.get("num_local_experts") or config.get("num_experts") or 0,
        experts_per_token=config.get("num_experts_per_tok") or 0,
        model_type=model_type,
    )
