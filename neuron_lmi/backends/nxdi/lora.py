"""NxD Inference's multi-LoRA serving (``modules/lora_serving/``), planned from ``option.enable_lora``.

The library compiles a fixed set of adapters in: ``NeuronConfig(lora_config=LoraServingConfig(...))``
with ``lora_ckpt_paths`` {name: folder}, and each row names its adapter by index in ``adapter_ids``
(``NeuronBaseForCausalLM.forward``; ``LoraModelManager.convert_adapter_ids_to_indices``)::

    option.enable_lora=true                    lora_config=LoraServingConfig(
    option.max_loras                             max_loras=max(max_loras, adapters),
    option.max_lora_rank                         max_lora_rank, max_cpu_loras,
    option.max_cpu_loras (None: max_loras)       batch_size=max_rolling_batch_size,
    option.lora_modules name=DIR, adapters/      lora_ckpt_paths={name: DIR, ...} (in this order),
                                                 target_modules: every adapter's, in first-seen order,
                                                 dynamic_multi_lora=False)
    (0.9 only)                                   enable_base_model_only=True: index 0 is the base model

An adapter's index is its place in ``lora_ckpt_paths`` (0.8: 0, 1, ...; 0.9 with
``enable_base_model_only``: 1, 2, ..., index 0 a zero adapter for rows of the base model). 0.8 has no
base-model index: ``adapter_ids`` default to zeros, which is the first adapter, so a row without an
adapter cannot be served beside adapted rows there (``base_rows``). Adapters are read here only for
what the library would take silently (``LoraServingConfig`` raises ``max_lora_rank`` to the largest
rank it reads, with a warning; this plan refuses instead, naming the adapter). Adapters loaded at
run time (``/v1/load_lora_adapter``) need ``dynamic_multi_lora``'s host-to-device swaps, not mapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_lmi.models.lora import AdapterError, read_adapter_config

if TYPE_CHECKING:
    from neuron_lmi.config.options import LoraOptions

ADAPTERS_FOLDER = "adapters"  # LMI's layout: <model>/adapters/<name>/


@dataclass(frozen=True, slots=True)
class NxdiLora:
    """The adapters compiled in. Invariants: ``names`` in ``lora_ckpt_paths`` order; ``index(name)``
    is what the library's ``adapter_ids`` carries for a row of that adapter; ``base_rows`` says
    whether a row without an adapter can share a batch with adapted rows."""

    kwargs: dict[str, Any]  # LoraServingConfig's keyword arguments (JSON values)
    names: tuple[str, ...]
    base_rows: bool

    def index(self, name: str | None) -> int:
        if name is None:
            if not self.base_rows:
                raise ValueError("NxD Inference 0.8 has no base-model adapter index")
            return 0
        return self.names.index(name) + (1 if self.base_rows else 0)


def start_up_adapters(lora: LoraOptions, model_path: Path) -> list[tuple[str, str]]:
    """``option.lora_modules`` then ``<model>/adapters/<name>/`` (names not given already)."""
    out = [(name, str(path)) for name, path in lora.lora_modules]
    folder = model_path / ADAPTERS_FOLDER
    if folder.is_dir():
        given = {name for name, _ in out}
        out += [(p.name, str(p)) for p in sorted(folder.iterdir()) if p.is_dir() and p.name not in given]
    return out


def plan_lora(lora: LoraOptions, model_path: Path, rows: int, base_model_index: bool) -> NxdiLora | None:
    """The LoRA part of the plan (None without ``option.enable_lora``); ``ValueError`` naming the key
    or the adapter. ``base_model_index``: the release has ``enable_base_model_only`` (0.9+)."""
    if not lora.enable_lora:
        return None
    adapters = start_up_adapters(lora, model_path)
    if not adapters:
        raise ValueError(
            "option.enable_lora: NxD Inference compiles its adapters in (lora_ckpt_paths); name them "
            f"with option.lora_modules or put them under {model_path / ADAPTERS_FOLDER}"
        )
    targets: list[str] = []
    for name, path in adapters:
        config = read_adapter_config(name, Path(path))
        if config.rank > lora.max_lora_rank:
            raise AdapterError(name, f"rank {config.rank} exceeds option.max_lora_rank={lora.max_lora_rank}")
        targets += [t for t in config.target_modules if t not in targets]
    kwargs: dict[str, Any] = {
        "max_loras": max(lora.max_loras, len(adapters)),
        "max_lora_rank": lora.max_lora_rank,
        "max_cpu_loras": max(lora.cpu_loras, len(adapters)),
        "batch_size": rows,
        "target_modules": targets,
        "lora_ckpt_paths": dict(adapters),
        "dynamic_multi_lora": False,
    }
    if base_model_index:
        kwargs["enable_base_model_only"] = True
    return NxdiLora(kwargs, tuple(name for name, _ in adapters), base_model_index)
