"""A backend is one object: ``plan -> compile -> load -> runner``, and one path that ``serve`` and
``neuron-lmi compile`` both walk.

    resolved config --plan--> plan (frozen: what to build, and one CompileUnit per cache entry)
                                |  for each unit: cache.get_or_compile(unit.inputs, backend.compile)
                                v
                              Artifacts (entry per unit, which ones compiled now)
                                |  backend.load(plan, artifacts)
                                v
                              runner (ModelRunner) -> EngineCore -> Engine

A cache miss is resolved here, above the runner: no runner calls a compiler. A plan with no units
(a torch model run eagerly, a user's artifact directory, NxD Inference on the CPU) loads straight
away. ``compile`` and ``load`` run in one process, so a backend may keep what ``compile`` built
(NxD Inference's application, the CPU engine's loaded weights) for ``load`` to reuse: a miss builds
the model once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from compile_cache import CacheKeyInputs, CompileCache, Entry
    from neuron_lmi.backends.registry import BuildRequest
    from neuron_lmi.engine.protocol import Engine


@dataclass(frozen=True, slots=True)
class CompileUnit:
    """One compile-cache entry a plan needs: ``name`` says which (``decode``, ``extend``, ``buckets``,
    ``neuron``) and ``inputs`` is its key."""

    name: str
    inputs: CacheKeyInputs


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """What ``neuron-lmi compile`` adds to the configuration (``serve`` uses the defaults).

    ``purpose``: ``serve`` (plan for this host), ``compile`` (plan for ``--platform``, compile with
    the installed libraries) or ``describe`` (``--dry-run``: plan, import no compiler).
    ``graphs``: the CPU engine's kind of graph (``frozen`` step packages, or AOT ``buckets``; None:
    as the configuration says). ``library_version``/``compiler_version``: the releases to key and map
    for (None: the installed ones). ``platform_key``: the name a platform error blames.
    ``cache_dir``: the local store's root (``--cache-dir``; None: ``option.compiled_graph_path``'s
    store, or the default one).
    """

    purpose: str = "serve"
    graphs: str | None = None
    library_version: str | None = None
    compiler_version: str | None = None
    platform_key: str = ""
    progress: bool = False
    cache_dir: str | None = None


@dataclass(frozen=True, slots=True)
class Artifacts:
    """The entries a plan's units resolved to, by unit name, and the units compiled by this call."""

    entries: Mapping[str, Entry]
    compiled: frozenset[str]
    seconds: float

    def entry(self, name: str) -> Entry:
        return self.entries[name]


NO_ARTIFACTS = Artifacts({}, frozenset(), 0.0)


class BackendPlan(Protocol):
    """A backend's frozen plan. ``units`` are the cache entries it needs (empty: nothing to compile);
    ``n_graphs`` how many graphs they hold; ``probe_token`` a token id that proves the loaded entries
    with one step on this host (None where ``load`` cannot run here: ``neuron-lmi compile`` then
    only stores them); ``describe`` is what ``--dry-run`` prints."""

    @property
    def units(self) -> tuple[CompileUnit, ...]: ...

    @property
    def n_graphs(self) -> int: ...

    @property
    def probe_token(self) -> int | None: ...

    def describe(self) -> dict[str, Any]: ...


class Backend(Protocol):
    """One backend folder's object, registered by name (``registry.register``)."""

    name: str

    def plan(self, request: BuildRequest, model_path: Path, options: CompileOptions) -> Any: ...

    def compile(self, plan: Any, unit: CompileUnit, out: Path) -> None: ...

    def load(self, plan: Any, artifacts: Artifacts) -> Any: ...

    def engine(self, request: BuildRequest) -> Engine: ...


def get_or_compile(
    backend: Backend, plan: BackendPlan, cache: CompileCache | None, no_compile: bool = False
) -> Artifacts:
    """Each of ``plan``'s units from ``cache``, compiled into it by ``backend.compile`` on a miss
    (unless ``no_compile``: then the store's ``CacheMissError``). A plan with no units needs no store."""
    started = time.monotonic()
    entries: dict[str, Entry] = {}
    compiled: set[str] = set()
    for unit in plan.units:
        if cache is None:
            raise ValueError(f"{backend.name}: the plan needs compiled graphs ({unit.name}) but no store")

        def compile_fn(out: Path, unit: CompileUnit = unit) -> None:
            compiled.add(unit.name)
            backend.compile(plan, unit, out)

        entries[unit.name] = cache.get_or_compile(unit.inputs, compile_fn, no_compile=no_compile)
    return Artifacts(entries, frozenset(compiled), time.monotonic() - started)


def load_runner(
    backend: Backend, plan: BackendPlan, cache: CompileCache | None, no_compile: bool = False
) -> Any:
    """The whole path below the configuration: artifacts for ``plan``, then the loaded runner."""
    return backend.load(plan, get_or_compile(backend, plan, cache, no_compile))
