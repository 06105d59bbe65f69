"""The CPU engine's LoRA settings, resolved from the configuration, and the adapter table it serves.

    option.enable_lora / max_loras / max_lora_rank / max_cpu_loras     -> CpuLora
    option.lora_modules (vLLM's --lora-modules name=path ...)          -> start-up adapters, fetched
    <model directory>/adapters/<name>/ (LMI's layout)                  -> start-up adapters too

The API process resolves and fetches (s3://, Hub) the start-up adapters; the engine process reads
them (``models.lora.load_adapter``) into its ``engine.lora.AdapterTable`` before it serves, so a bad
one stops the start with its name and the reason.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuron_lmi.engine.lora import AdapterTable
from neuron_lmi.engine.types import InvalidRequestError
from neuron_lmi.model_source import HUB_ID, fetch_adapter, model_cache_dir
from neuron_lmi.models.lora import load_adapter

if TYPE_CHECKING:
    from neuron_lmi.config import ResolvedConfig

log = logging.getLogger(__name__)

ADAPTERS_FOLDER = "adapters"


@dataclass(frozen=True, slots=True)
class CpuLora:
    """LoRA on the CPU engine: ``max_loras`` runner slots of rank up to ``max_lora_rank``,
    ``max_cpu_loras`` host copies, the start-up adapters ``modules`` as (name, local directory), and
    the names the base model goes by (an adapter's ``base_model_name_or_path`` is checked against
    them)."""

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


def cpu_lora(
    resolved: ResolvedConfig, model_path: Path, env: Mapping[str, str] | None = None
) -> CpuLora | None:
    """The configuration's LoRA settings for the model at ``model_path``; None without
    ``option.enable_lora`` (``option.lora_modules`` alone is refused, as vLLM refuses it)."""
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
    return CpuLora(
        lora.max_loras,
        lora.max_lora_rank,
        lora.cpu_loras,
        tuple(modules),
        base_names_of(resolved.config.model.model_id, Path(model_path)),
    )


def adapter_table(lora: CpuLora, model: Any) -> AdapterTable:
    """The engine's adapter table for ``model``, with the start-up adapters registered; raises
    ``ValueError`` naming the adapter that cannot be served."""
    projections = model.lora_projections()

    def load(name: str, path: str) -> Any:
        rank, names = lora.max_lora_rank, lora.base_names
        return load_adapter(name, path, model.args, projections, rank, names, model.dtype)

    table = AdapterTable(lora.max_loras, lora.max_cpu_loras, load)
    for name, path in lora.modules:
        try:
            table.register(name, path)
        except InvalidRequestError as exc:
            raise ValueError(f"option.lora_modules: {exc}") from None
        log.info("LoRA adapter %s served from %s", name, path)
    return table
