"""vLLM behind neuron-lmi's Engine protocol.

Importing this package never imports vLLM: ``VllmEngine`` and the mapping helpers load it only
when an engine is built, so the main environment (no vLLM) can import and unit-test the mapping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["VllmEngine", "VllmEngineConfig"]

if TYPE_CHECKING:
    from gpu_fallback.config import VllmEngineConfig
    from gpu_fallback.engine import VllmEngine


def __getattr__(name: str) -> Any:
    if name == "VllmEngine":
        from gpu_fallback.engine import VllmEngine

        return VllmEngine
    if name == "VllmEngineConfig":
        from gpu_fallback.config import VllmEngineConfig

        return VllmEngineConfig
    raise AttributeError(f"module 'gpu_fallback' has no attribute {name!r}")
