"""Configuration of the vLLM backend and its one-to-one mapping onto vLLM's engine arguments.

LMI names (``option.tensor_parallel_degree``, ``option.max_rolling_batch_size``, ``option.n_positions``,
``option.dtype`` and the vLLM-specific ``option.gpu_memory_utilization`` / ``option.enforce_eager`` /
``option.max_model_len``) are read through ``LMI_KEYS``; nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Our dtype names (LMI's fp32/fp16/bf16 and torch's) -> vLLM's.
DTYPES = {
    "auto": "auto",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
}


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true/false, got {value!r}")


def _tp(value: Any) -> int | str:
    return "max" if str(value).strip().lower() == "max" else int(value)


@dataclass(frozen=True, slots=True)
class VllmEngineConfig:
    """What the vLLM backend needs. Invariant: every field is validated in ``__post_init__``.

    ``n_positions`` None lets vLLM use the model's own maximum; ``tensor_parallel_degree`` may be
    "max" (every visible GPU). ``max_queue_size`` bounds requests waiting beyond the rolling batch.
    """

    model: str
    served_model_name: str | None = None
    tensor_parallel_degree: int | str = 1
    max_rolling_batch_size: int = 32
    n_positions: int | None = None
    dtype: str = "auto"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    chat_template: str | None = None
    trust_remote_code: bool = False
    seed: int = 0
    max_queue_size: int = 256
    kv_cache_memory_bytes: int | None = None
    extra_engine_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model directory or file")
        if self.tensor_parallel_degree != "max" and (
            not isinstance(self.tensor_parallel_degree, int) or self.tensor_parallel_degree < 1
        ):
            raise ValueError(
                f"tensor_parallel_degree must be >= 1 or 'max', got {self.tensor_parallel_degree!r}"
            )
        if self.max_rolling_batch_size < 1:
            raise ValueError(f"max_rolling_batch_size must be >= 1, got {self.max_rolling_batch_size!r}")
        if self.n_positions is not None and self.n_positions < 2:
            raise ValueError(f"n_positions must be >= 2, got {self.n_positions!r}")
        if self.dtype.lower() not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not (0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size must be >= 0, got {self.max_queue_size!r}")

    @classmethod
    def from_lmi(cls, options: Mapping[str, Any], **overrides: Any) -> VllmEngineConfig:
        """Build from LMI keys (with or without the ``option.`` prefix); unknown keys are ignored here."""
        kwargs: dict[str, Any] = {}
        for key, value in options.items():
            if value is None:
                continue
            bare = key[len("option.") :] if key.startswith("option.") else key
            target = LMI_KEYS.get(bare)
            if target is not None:
                name, convert = target
                try:
                    kwargs[name] = convert(value)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"option.{bare}={value!r}: {exc}") from exc
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)


# LMI key -> (our field, conversion). option.max_model_len is LMI's vLLM spelling of n_positions.
LMI_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "model_id": ("model", str),
    "served_model_name": ("served_model_name", str),
    "tensor_parallel_degree": ("tensor_parallel_degree", _tp),
    "max_rolling_batch_size": ("max_rolling_batch_size", int),
    "n_positions": ("n_positions", int),
    "max_model_len": ("n_positions", int),
    "dtype": ("dtype", str),
    "enforce_eager": ("enforce_eager", _bool),
    "gpu_memory_utilization": ("gpu_memory_utilization", float),
    "chat_template": ("chat_template", str),
    "trust_remote_code": ("trust_remote_code", _bool),
    "seed": ("seed", int),
    "max_queue_size": ("max_queue_size", int),
}


def engine_args_kwargs(
    config: VllmEngineConfig, model_dir: str | Path, device_count: int = 1
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.AsyncEngineArgs`` (``model_dir`` is the resolved HF directory)."""
    tp = max(1, device_count) if config.tensor_parallel_degree == "max" else config.tensor_parallel_degree
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "served_model_name": config.served_model_name,
        "tensor_parallel_size": tp,
        "max_num_seqs": config.max_rolling_batch_size,
        "max_model_len": config.n_positions,
        "dtype": DTYPES[config.dtype.lower()],
        "enforce_eager": config.enforce_eager,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "trust_remote_code": config.trust_remote_code,
        "seed": config.seed,
        # Our own stat logger still receives scheduler stats; this only drops vLLM's 5 s log line.
        "disable_log_stats": True,
    }
    if config.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    kwargs.update(config.extra_engine_args)
    return {k: v for k, v in kwargs.items() if v is not None}


def load_chat_template(value: str | None) -> str | None:
    """A chat template given inline or as a path to a Jinja file."""
    if value is None:
        return None
    path = Path(value)
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text(encoding="utf-8")
    return value
