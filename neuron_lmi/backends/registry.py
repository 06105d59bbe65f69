"""Backends by name: each backend folder registers its one object (``register_backend``), whose
``engine`` builds its Engine and whose ``plan``/``compile``/``load`` are the path ``serve`` and
``neuron-lmi compile`` share (``backends.backend``). A backend with nothing to compile (vLLM)
registers only an engine builder (``register(name, builder)``).

    neuron-lmi serve:    configuration -> dispatch.choose_backend -> name -> get(name)(request) -> Engine
    neuron-lmi compile:  configuration -> target -> name -> backend(name).plan -> compile -> load

A backend's module registers when it is imported.
``BUILTIN_MODULES`` says where the built-in backends live, as strings, so ``get`` imports a backend
(and its libraries: torch models, NxD Inference, vLLM) only when it is chosen. Nothing here imports
``neuron_lmi.commands``, and no backend does either.

    cpu          neuron_lmi.backends.cpu.backend   the torch reference engine
    neuron-tnx   neuron_lmi.backends.tnx.backend   transformers-neuronx runner
    neuron-nxdi  neuron_lmi.backends.nxdi.backend  NxD Inference runner
    vllm         gpu_fallback.serve              vLLM on CUDA
    vllm-neuron  gpu_fallback.serve              vLLM with the vllm-neuron plugin
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neuron_lmi.backends.backend import Backend
    from neuron_lmi.backends.dispatch import BackendChoice
    from neuron_lmi.config import ResolvedConfig
    from neuron_lmi.engine.protocol import Engine

log = logging.getLogger(__name__)

BUILTIN_MODULES: Mapping[str, str] = MappingProxyType(
    {
        "cpu": "neuron_lmi.backends.cpu.backend",
        "neuron-tnx": "neuron_lmi.backends.tnx.backend",
        "neuron-nxdi": "neuron_lmi.backends.nxdi.backend",
        "vllm": "gpu_fallback.serve",
        "vllm-neuron": "gpu_fallback.serve",
    }
)


@dataclass(frozen=True, slots=True)
class BuildRequest:
    """Everything a builder gets. ``tp_degree`` is ``tensor_parallel_degree`` with ``max`` already
    resolved for the chosen backend (visible NeuronCores, visible GPUs, or 1 on the CPU engine);
    ``choice`` says which library and why (None when a caller builds a backend by name)."""

    resolved: ResolvedConfig
    env: Mapping[str, str]
    backend: str
    tp_degree: int
    choice: BackendChoice | None = None


EngineBuilder = Callable[[BuildRequest], "Engine"]

_BUILDERS: dict[str, EngineBuilder] = {}
_BACKENDS: dict[str, Backend] = {}


def register(name: str, builder: EngineBuilder) -> None:
    """Make ``builder`` the one that builds backend ``name``.

    Registering the same function again is a no-op (a module imported twice, e.g. once as
    ``__main__``, registers functions of the same qualified name); a different function for a name
    already taken raises ``ValueError``: two backends must not claim one name.
    """
    if not name or not callable(builder):
        raise ValueError(f"register: need a backend name and a callable, got {name!r}, {builder!r}")
    old = _BUILDERS.get(name)
    if old is not None and _qualname(old) != _qualname(builder):
        raise ValueError(f"backend {name!r} is already built by {_qualname(old)}, not {_qualname(builder)}")
    _BUILDERS[name] = builder


def register_backend(backend: Backend) -> None:
    """Register a backend folder's object under ``backend.name``: its ``engine`` is the builder."""
    register(backend.name, backend.engine)
    _BACKENDS[backend.name] = backend


def backend(name: str) -> Backend:
    """The object of backend ``name`` (importing its built-in module first when needed); a backend
    that registered only an engine builder compiles nothing, and is a ``LookupError`` here."""
    get(name)
    found = _BACKENDS.get(name)
    if found is None:
        raise LookupError(f"backend {name!r} has nothing to compile (it builds its engine only)")
    return found


def get(name: str) -> EngineBuilder:
    """The builder for ``name``, importing its built-in module first when needed."""
    if name not in _BUILDERS and name in BUILTIN_MODULES:
        importlib.import_module(BUILTIN_MODULES[name])
    builder = _BUILDERS.get(name)
    if builder is None:
        known = ", ".join(sorted({*BUILTIN_MODULES, *_BUILDERS}))
        raise LookupError(f"no engine builder is registered for backend {name!r}; known: {known}")
    return builder


def registered() -> tuple[str, ...]:
    """Names with a builder registered so far (built-in backends appear once imported)."""
    return tuple(sorted(_BUILDERS))


def _qualname(fn: Callable[..., object]) -> str:
    return f"{getattr(fn, '__qualname__', repr(fn))}"
