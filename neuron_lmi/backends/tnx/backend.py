"""Backend ``neuron-tnx`` as one object: plan (``args``: the ``NeuronCompileSpec`` and the library's
arguments, the compile cache URL for neuronx-cc) -> compile (``from_pretrained`` + ``to_neuron`` +
``save`` into one cache entry) -> load (``load(entry)`` + ``to_neuron``, wrapped in ``NeuronRunner``).

transformers-neuronx is for Neuron SDK <= 2.25. On a miss the model compiled into the entry is the
one served, never built a second time. ``neuron-lmi compile --target neuron --model-loader tnx``
fills the same entries.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compile_cache import CacheKeyInputs, architecture_config
from neuron_lmi.backends import registry
from neuron_lmi.backends.backend import NO_ARTIFACTS, Artifacts, CompileOptions, CompileUnit, load_runner
from neuron_lmi.backends.common import cache_for, fetch, rolling_batch_engine, with_model_defaults
from neuron_lmi.backends.host import TNX, installed_version
from neuron_lmi.backends.tnx.args import (
    MappedNeuronArgs,
    NeuronCompileSpec,
    build_neuron_config,
    compile_spec_from_config,
    read_model_config,
)
from neuron_lmi.backends.tnx.compile import (
    compile_neuron_entry,
    load_neuron_model,
    neuron_key_inputs,
    plan_neuron_compile,
    sampling_class_path,
)
from neuron_lmi.backends.tnx.runner import NeuronRunner, SamplingModel

log = logging.getLogger(__name__)

NOT_INSTALLED = "not-installed"


@dataclass(frozen=True, eq=False)
class TnxBuildPlan:
    """The spec, the library's arguments, the architecture and the entry's key (one unit)."""

    spec: NeuronCompileSpec
    mapped: MappedNeuronArgs
    architecture: str
    vocab_size: int
    inputs: CacheKeyInputs
    units: tuple[CompileUnit, ...]
    probe_token = None  # NEFFs run on NeuronCores only

    @property
    def n_graphs(self) -> int:
        return len(self.mapped.context_buckets) + len(self.mapped.token_buckets)

    def describe(self) -> dict[str, Any]:
        module, name = sampling_class_path(self.architecture)
        version = installed_version(TNX.distribution)
        return {
            "library": "transformers-neuronx",
            # The kwargs are ones every release takes (batch_size_for_shared_caches, not 0.13's
            # max_num_seqs); 0.13 is the last release, for Neuron SDK <= 2.25.
            "library_version": version or "0.13",
            "library_version_source": "installed"
            if version
            else "assumed: not installed, Neuron SDK <= 2.25",
            "application_class": f"{module}.{name}",
            "from_pretrained_kwargs": self.mapped.from_pretrained_kwargs,
            "neuron_config_class": "transformers_neuronx.NeuronConfig",
            "neuron_config_kwargs": self.mapped.neuron_config,
            "environment": self.mapped.env,
            "context_buckets": list(self.mapped.context_buckets),
            "token_buckets": list(self.mapped.token_buckets),
            "cache_key": self.inputs.key(),
            "cache_key_inputs": self.inputs.describe(),
        }


class TnxBackend:
    """transformers-neuronx's backend object (see the module docstring)."""

    name = "neuron-tnx"

    def __init__(self) -> None:
        # The model compile built, by plan: it is ready to serve, so load takes it instead of loading.
        self._compiled: dict[int, Any] = {}

    def plan(self, request: registry.BuildRequest, model_path: Path, options: CompileOptions) -> TnxBuildPlan:
        """``compiler_version`` keys the entry (default: the installed neuronx-cc; a review without it
        keys ``not-installed``, a compile or a start without it fails naming the package)."""
        resolved = with_model_defaults(request.resolved, model_path)
        model_config = read_model_config(str(model_path))
        spec = compile_spec_from_config(resolved.config, str(model_path), request.tp_degree, model_config)
        # neuronx-cc's own cache goes inside the store the entry goes to.
        store = cache_for(resolved.config.neuron.compiled_graph_path, options.cache_dir)
        mapped = plan_neuron_compile(spec, store, request.env)
        for note in mapped.notes:
            log.warning("transformers-neuronx: %s", note)
        architecture = _architecture(model_config)
        sampling_class_path(architecture)  # an architecture without a class fails here, by name
        version = options.compiler_version or installed_version("neuronx-cc")
        if options.purpose != "compile":  # a compile needs the version; a review or a start says so
            version = version or NOT_INSTALLED
        inputs = neuron_key_inputs(spec, mapped, architecture_config(dict(model_config)), version)
        units = (CompileUnit("neuron", inputs),)
        return TnxBuildPlan(spec, mapped, architecture, int(model_config["vocab_size"]), inputs, units)

    def compile(self, plan: TnxBuildPlan, unit: CompileUnit, out: Path) -> None:
        self._compiled[id(plan)] = compile_neuron_entry(plan.mapped, plan.architecture, out)

    def load(
        self, plan: TnxBuildPlan, artifacts: Artifacts, model: SamplingModel | None = None
    ) -> NeuronRunner:
        """The runner over the ready model (``model`` replaces it: tests pass a ``ContractModel``).
        Without the Neuron SDK this raises ``RuntimeError`` naming the packages and AWS's pip
        repository."""
        if model is None:
            entry = artifacts.entry("neuron")
            model = self._compiled.pop(id(plan), None)
            if model is not None:
                log.info(
                    "Neuron artifacts: compiled into cache entry %s (%s); serving that model",
                    entry.key,
                    entry.path,
                )
            else:
                log.info("Neuron artifacts: compile cache entry %s (%s)", entry.key, entry.path)
                model = load_neuron_model(plan.mapped, plan.architecture, entry.path)
        return NeuronRunner(
            model, plan.spec.batch_size, plan.spec.n_positions, plan.vocab_size, plan.mapped.context_buckets
        )

    def engine(self, request: registry.BuildRequest) -> Any:
        """``serve``: fetch, then plan -> compile on a miss -> load, in a rolling-batch engine."""
        path = fetch(request.resolved, request.env)
        resolved = with_model_defaults(request.resolved, path)
        runner = build_neuron_runner(dataclasses.replace(request, resolved=resolved), path)
        return rolling_batch_engine(runner, path, resolved, self.name)


def build_neuron_runner(
    request: registry.BuildRequest,
    model_path: str | Path,
    model: SamplingModel | None = None,
    compiler_version: str | None = None,
    cache_dir: str | None = None,
) -> NeuronRunner:
    """Plan, compile on a miss into ``option.compiled_graph_path``'s store (``cache_dir``: that root;
    else the default store), and load; ``model`` replaces the library's model, and then nothing is
    compiled or loaded (tests pass a ``ContractModel``)."""
    options = CompileOptions(compiler_version=compiler_version, cache_dir=cache_dir)
    plan = TNX_BACKEND.plan(request, Path(model_path), options)
    if model is not None:
        return TNX_BACKEND.load(plan, NO_ARTIFACTS, model=model)
    build_neuron_config(plan.mapped)  # fails first, naming the missing Neuron packages
    store = cache_for(request.resolved.config.neuron.compiled_graph_path, cache_dir)
    return load_runner(TNX_BACKEND, plan, store)


def _architecture(model_config: Mapping[str, Any]) -> str:
    names = model_config.get("architectures") or []
    if not names:
        raise ValueError("config.json names no architecture ('architectures' is empty)")
    return str(names[0])


TNX_BACKEND = TnxBackend()
registry.register_backend(TNX_BACKEND)
