"""LoRA settings and start-up adapters, resolved once from the configuration for every backend.

    option.enable_lora / max_loras / max_lora_rank / max_cpu_loras     -> LoraSettings
    option.lora_modules (vLLM's --lora-modules name=path ...)          -> start-up adapters, fetched
    <model directory>/adapters/<name>/ (LMI's layout)                  -> start-up adapters too

The API process resolves and fetches (s3://, Hub) the start-up adapters here; each backend then
reads them its own way (the CPU engine into its ``engine.lora.AdapterTable``, the vLLM backend
through ``AsyncLLM.add_lora``), after the shared checks of ``models.lora.check_adapter``, so a bad
one stops the start with its name and the reason on either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from neuron_lmi.model_source import HUB_ID, fetch_adapter, model_cache_dir

if TYPE_CHECKING:
    from neuron_lmi.config import ResolvedConfig

ADAPTERS_FOLDER = "adapters"


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """LoRA on a backend: ``max_loras`` resident adapters of rank up to ``max_lora_rank``,
    ``max_cpu_loras`` host copies (>= ``max_loras``), the start-up adapters ``modules`` as (name,
    local directory), and the names the base model goes by (an adapter's ``base_model_name_or_path``
    is checked against them)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    modules: tuple[tuple[str, str], ...]
    base_names: tuple[str, ...]


def base_names_of(model_id: str | None, model_path: Path) -> tuple[str, ...]:
    """The names an adapter's ``base_model_name_or_path`` is checked against: the Hub id the model
    was served by. A local directory, an S3 prefix or SageMaker's ``/opt/ml/model`` names nothing an
    adapter could have recorded, so there only the weights' shapes decide."""
    if model_id and HUB_ID.fullmatch(model_id) and not Path(model_id).exists():
        return (model_id,)
    return ()


def resolve_lora(
    resolved: ResolvedConfig, model_path: Path, env: Mapping[str, str] | None = None
) -> LoraSettings | None:
    """The configuration's LoRA settings for the model at ``model_path``, its start-up adapters
    fetched; None without ``option.enable_lora`` (``option.lora_modules`` alone is refused, as vLLM
    refuses it). A name given twice (also by ``adapters/``) raises ``ValueError``."""
    lora = resolved.config.lora
    if not lora.enable_lora:
        if lora.lora_modules:
            raise ValueError("option.lora_modules needs option.enable_lora=true")
        return None
    env = os.environ if env is None else env
    cache = model_cache_dir(env)
    modules = [(name, str(fetch_adapter(path, cache, env))) for name, path in lora.lora_modules]
    folder = Path(model_path) / ADAPTERS_FOLDER
    if folder.is_dir():
        modules += [(sub.name, str(sub)) for sub in sorted(folder.iterdir()) if sub.is_dir()]
    names = [name for name, _ in modules]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"option.lora_modules: adapter name(s) {repeated} given twice (or also in adapters/)"
        )
    return LoraSettings(
        lora.max_loras,
        lora.max_lora_rank,
        lora.cpu_loras,
        tuple(modules),
        base_names_of(resolved.config.model.model_id, Path(model_path)),
    )
