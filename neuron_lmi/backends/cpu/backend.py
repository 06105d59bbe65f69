"""Backend ``cpu`` as one object: plan (the model as served, and the graphs it runs) -> compile (one
cache entry per graph package) -> load (the runner, built complete with its compiled graphs).

    eager     no units: the torch model, bf16 weights packed for oneDNN
    frozen    units ``step`` (the step graph) and ``extend`` (where the step graph leaves prompt
              chunks to it): AOTInductor packages with frozen weights (``compiled_decode``,
              ``compiled_extend``); what ``serve`` runs unless ``option.enforce_eager``
    buckets   one unit ``buckets``: a graph per context and token-generation bucket
              (``aot``), with ``option.compiled_graph_path``

The plan holds the loaded model: a frozen package's key covers the model as built (quantized,
sharded), and ``compile`` traces those very weights, which ``load`` then binds the graphs to.
``serve`` runs this path in the engine process (``engine.build_cpu_engine_core``);
``neuron-lmi compile --target cpu`` runs it through ``plan``, so both compute the same keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from compile_cache import normalize_dtype
from neuron_lmi.backends import registry
from neuron_lmi.backends.backend import Artifacts, CompileOptions, CompileUnit
from neuron_lmi.backends.common import fetch, model_name
from neuron_lmi.backends.cpu.aot import CompiledGraphs, CpuPlan, compile_cpu_entry, cpu_key_inputs
from neuron_lmi.backends.cpu.aot_runner import CompiledCpuRunner
from neuron_lmi.backends.cpu.compiled_decode import (
    CompiledDecode,
    FrozenPackage,
    StepLora,
    chunk_pair_limit,
    compile_decode_package,
    decode_key_inputs,
    decode_unsupported,
    extend_graph_needed,
)
from neuron_lmi.backends.cpu.compiled_extend import CompiledExtend
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.models.packed import pack_model

log = logging.getLogger(__name__)

GRAPH_KINDS = ("eager", "frozen", "buckets")
# Unit names are the packages' graph names (the key's ``graph=``).
FROZEN: dict[str, type[FrozenPackage]] = {
    CompiledDecode.graph: CompiledDecode,
    CompiledExtend.graph: CompiledExtend,
}


@dataclass(frozen=True, eq=False)
class CpuBuildPlan:
    """The CPU engine's plan: ``options`` as served, the checkpoint and the model built from it
    (``engine.load_cpu_model``), which graphs (``graphs``, one of ``GRAPH_KINDS``) and their units.
    Invariant: ``units`` are exactly the entries ``load`` opens; ``aot`` is set iff ``buckets``."""

    options: Any  # engine.CpuEngineOptions (None for a bucket plan built from a model alone)
    path: Path
    checkpoint: Any
    model: Any
    n_rows: int
    n_positions: int
    graphs: str
    units: tuple[CompileUnit, ...]
    aot: CpuPlan | None = None
    progress: bool = False
    step_lora: StepLora | None = None  # the step package's adapter inputs (option.enable_lora)

    @property
    def n_graphs(self) -> int:
        return len(self.aot.graphs()) if self.aot is not None else len(self.units)

    @property
    def probe_token(self) -> int | None:
        """A one-token prompt that proves the loaded entries run (the tokenizer's BOS)."""
        bos = getattr(getattr(self.checkpoint, "config", None), "bos_token_id", None)
        return int(bos) if isinstance(bos, int) else 0

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "cpu",
            "model": str(self.path),
            "graphs": self.graphs,
            "dtype": self.aot.dtype if self.aot is not None else self.options.dtype_name(),
            "n_rows": self.n_rows,
            "n_positions": self.n_positions,
            "units": [{"name": u.name, "key": u.inputs.key()} for u in self.units],
        }


class CpuBackend:
    """The torch reference engine's backend object (see the module docstring)."""

    name = "cpu"

    def plan(self, request: registry.BuildRequest, model_path: Path, options: CompileOptions) -> CpuBuildPlan:
        """``neuron-lmi compile --target cpu``: the model as ``serve`` builds it with these settings,
        and ``options.graphs`` (default: ``buckets`` with ``option.compiled_graph_path``, else the
        ``frozen`` packages serve runs). ``option.compiled_graph_path`` is the store written into."""
        from neuron_lmi.backends.cpu.engine import CpuEngineOptions  # engine.py imports this module

        if options.purpose == "describe":
            raise ValueError("--dry-run: only the neuron target has a dry run")
        if request.tp_degree != 1:
            raise ValueError("--tensor-parallel-degree: the cpu target compiles one rank (use 1)")
        engine_options = CpuEngineOptions.from_resolved(request.resolved, model_path, tp_degree=1)
        graphs = options.graphs or ("buckets" if engine_options.compiled_graph_path else "frozen")
        if graphs not in GRAPH_KINDS[1:]:
            raise ValueError(f"--graphs: one of frozen, buckets, got {graphs!r}")
        if graphs == "buckets" and engine_options.quantize:
            raise ValueError("--quantize: the bucket graphs take dense weights (use --graphs frozen)")
        engine_options = replace(engine_options, compiled_graph_path=None)
        if engine_options.dtype_name() not in ("fp32", "bf16"):
            raise ValueError(f"--dtype: the cpu target supports fp32, bf16, got {engine_options.dtype!r}")
        plan = self.plan_for(engine_options, graphs, progress=options.progress)
        if graphs == "frozen" and not plan.units:
            reason = decode_unsupported(plan.model, plan.n_rows, plan.n_positions)
            raise ValueError(f"--graphs frozen: this model and cache shape run eagerly ({reason})")
        return plan

    def plan_for(self, options: Any, graphs: str | None = None, progress: bool = False) -> CpuBuildPlan:
        """The plan for ``options`` (``CpuEngineOptions``): the model loaded, and ``graphs`` (default as
        the options say: ``buckets`` when ``compiled``/``compiled_graph_path``, ``frozen`` when
        ``compile_graphs``, else ``eager``)."""
        from neuron_lmi.backends.cpu.engine import load_cpu_model  # engine.py imports this module

        options.validate_quantize()
        if graphs is None:
            compiled = options.compiled or options.compiled_graph_path
            graphs = "buckets" if compiled else "frozen" if options.compile_graphs else "eager"
        path = Path(options.model)
        checkpoint, model, n_positions = load_cpu_model(options, path)
        n_rows = options.max_rolling_batch_size
        if graphs == "buckets":
            estimate = tuple(options.context_length_estimate) if options.context_length_estimate else None
            aot = CpuPlan.default(n_rows, n_positions, normalize_dtype(options.dtype_name()), estimate)
            return bucket_plan(model, path, aot, options, checkpoint, progress)
        if graphs == "frozen":
            lora = step_lora(options, model)
            return frozen_plan(model, path, n_rows, n_positions, options, checkpoint, lora)
        return CpuBuildPlan(options, path, checkpoint, model, n_rows, n_positions, graphs, ())

    def compile(self, plan: CpuBuildPlan, unit: CompileUnit, out: Path) -> None:
        log.info("compile cache miss key=%s: compiling the %s graphs (minutes)", unit.inputs.key(), unit.name)
        if unit.name == "buckets":
            if plan.aot is None:
                raise ValueError("compile: a buckets unit in a plan without buckets")
            compile_cpu_entry(plan.model, plan.aot, out, progress=plan.progress)
        elif unit.name == CompiledDecode.graph:
            compile_decode_package(plan.model, plan.n_rows, plan.n_positions, out, plan.step_lora)
        else:
            FROZEN[unit.name].compile_package(plan.model, plan.n_rows, plan.n_positions, out)

    def load(self, plan: CpuBuildPlan, artifacts: Artifacts) -> CpuRunner | CompiledCpuRunner:
        """The runner, complete: the bucket runner on its graphs, or the eager runner with the frozen
        packages it runs (a package this torch cannot open is logged and that graph runs eagerly)."""
        for name, entry in artifacts.entries.items():
            done = "compiled" if name in artifacts.compiled else "loaded"
            log.info("compiled %s: key=%s %s (%s)", name, entry.key, done, entry.path)
        lora = getattr(plan.options, "lora", None)
        if plan.aot is not None:
            if lora is not None:
                raise ValueError(
                    "option.enable_lora: the AOT bucket runner (option.compiled_graph_path) takes no adapters"
                )
            graphs = CompiledGraphs(plan.model, artifacts.entry("buckets").path, plan.aot)
            return CompiledCpuRunner(plan.model, graphs)
        packages = {name: _open_package(plan, name, artifacts) for name in artifacts.entries}
        runner = CpuRunner(
            plan.model,
            plan.n_rows,
            plan.n_positions,
            compiled_decode=packages.get(CompiledDecode.graph),  # type: ignore[arg-type]
            compiled_extend=packages.get(CompiledExtend.graph),  # type: ignore[arg-type]
            lora_slots=lora.max_loras if lora is not None else 0,
            lora_rank=lora.max_lora_rank if lora is not None else 0,
        )
        # After the compiled graphs, which trace dense weights; packing is for the eager runner.
        if plan.options is None or plan.options.pack_weights:
            pack_model(plan.model)
        return runner

    def engine(self, request: registry.BuildRequest) -> Any:
        """``serve``: the model fetched first (built-in, local, s3://, Hub); the engine process then
        walks plan -> compile -> load from the configuration's CPU view (``CpuEngineOptions``)."""
        from neuron_lmi.backends.cpu import engine as cpu  # engine.py imports this module

        path = fetch(request.resolved, request.env)
        options = cpu.CpuEngineOptions.from_resolved(request.resolved, path, request.tp_degree)
        options = options.with_draft_fetched(request.resolved.config.model.model_loading_timeout, request.env)
        return cpu.cpu_process_engine(options, model_name=model_name(request.resolved))


def bucket_plan(
    model: Any,
    path: Path,
    aot: CpuPlan,
    options: Any = None,
    checkpoint: Any = None,
    progress: bool = False,
) -> CpuBuildPlan:
    """The plan of the AOT bucket runner for ``model`` (loaded from ``path``) and ``aot``'s buckets."""
    unit = CompileUnit("buckets", cpu_key_inputs(model, path, aot))
    return CpuBuildPlan(
        options, Path(path), checkpoint, model, aot.n_rows, aot.n_positions, "buckets", (unit,), aot, progress
    )


def step_lora(options: Any, model: Any) -> StepLora | None:
    """The step package's adapter inputs where ``options`` serve LoRA adapters (``option.enable_lora``)
    on a model that can run them; None otherwise."""
    lora = getattr(options, "lora", None)
    projections = model.lora_projections() if lora is not None else frozenset()
    if lora is None or not projections:
        return None
    return StepLora(lora.max_loras, lora.max_lora_rank, tuple(sorted(projections)))


def frozen_plan(
    model: Any,
    path: Path,
    n_rows: int,
    n_positions: int,
    options: Any = None,
    checkpoint: Any = None,
    lora: StepLora | None = None,
) -> CpuBuildPlan:
    """The plan of the frozen packages for ``model`` (loaded from ``path``): the step package (with
    ``lora``'s adapter inputs), and the extend package where the step graph leaves prompt chunks to
    it; no units (logged) where the model or cache shape has no compiled step."""
    names: list[str] = []
    reason = decode_unsupported(model, n_rows, n_positions)
    if reason is not None:
        log.info("compiled graphs off: %s; running eagerly", reason)
    elif extend_graph_needed(model, n_rows, n_positions):
        names = [CompiledDecode.graph, CompiledExtend.graph]
    else:
        log.info("compiled extend not needed: the step graph runs every prompt chunk")
        names = [CompiledDecode.graph]
    units = tuple(
        CompileUnit(name, decode_key_inputs(model, path, n_rows, n_positions, FROZEN[name].graph, lora))
        for name in names
    )
    return CpuBuildPlan(
        options, Path(path), checkpoint, model, n_rows, n_positions, "frozen", units, step_lora=lora
    )


def _open_package(plan: CpuBuildPlan, name: str, artifacts: Artifacts) -> FrozenPackage | None:
    kind, entry = FROZEN[name], artifacts.entry(name)
    limit = kind.size_limit(plan.model, plan.n_rows, plan.n_positions)
    try:
        lora = plan.step_lora if kind is CompiledDecode else None
        package = kind(entry.path / kind.package_file, limit, plan.n_positions, lora)
    except Exception as exc:  # a package this torch cannot open: the engine runs eagerly, never crashes
        log.error("compiled %s off: the package of key=%s at %s failed to load (%s); running it eagerly",
                  name, entry.key, entry.path, exc)  # fmt: skip
        return None
    if isinstance(package, CompiledDecode):
        package.pair_limit = chunk_pair_limit(plan.model)
    return package


CPU_BACKEND = CpuBackend()
registry.register_backend(CPU_BACKEND)
