"""The one table of floating-point dtypes: LMI's names (``fp32``, ``bf16``, ``fp16``), the aliases
clients and configs use for them, and what each backend calls them.

Every name the configuration accepts maps onto a canonical name (``canonical_dtype``); every
backend reads its own column from ``DTYPES`` by that name. The compile cache keeps its own alias
list (``compile_cache.key``): it is a library below this package, and its keys must not move when
this table grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class DType:
    """One dtype as each consumer names it."""

    name: str  # LMI's: what option.dtype holds once resolved
    aliases: tuple[str, ...]  # other spellings clients send (torch's, transformers-neuronx's, "half")
    torch_name: str  # torch's attribute (torch.bfloat16) and vLLM's and NxD Inference's name
    amp: str  # transformers-neuronx's ``amp``
    n_bytes: int  # bytes per value (the planner's memory sums)


DTYPES = MappingProxyType(
    {
        d.name: d
        for d in (
            DType("fp32", ("float32", "f32", "float"), "float32", "f32", 4),
            DType("bf16", ("bfloat16",), "bfloat16", "bf16", 2),
            DType("fp16", ("float16", "f16", "half"), "float16", "f16", 2),
        )
    }
)
ALIASES = MappingProxyType({alias: d.name for d in DTYPES.values() for alias in (d.name, *d.aliases)})


def canonical_dtype(name: str) -> str | None:
    """LMI's name for ``name`` (any alias, any case, a ``torch.`` prefix allowed); None if unknown."""
    return ALIASES.get(name.strip().lower().removeprefix("torch."))
