"""The CPU engine's adapter table, built from the LoRA settings every backend shares.

The settings and the start-up adapters (``option.lora_modules``, the model's ``adapters/``) are
resolved in ``backends.lora``; the engine process reads them (``models.lora.load_adapter``) into its
``engine.lora.AdapterTable`` before it serves, so a bad one stops the start with its name and the
reason.
"""

from __future__ import annotations

import logging
from typing import Any

from neuron_lmi.backends.lora import LoraSettings
from neuron_lmi.engine.lora import AdapterTable
from neuron_lmi.engine.types import InvalidRequestError
from neuron_lmi.models.lora import load_adapter

log = logging.getLogger(__name__)


def adapter_table(lora: LoraSettings, model: Any) -> AdapterTable:
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
