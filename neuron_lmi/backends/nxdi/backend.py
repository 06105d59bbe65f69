"""Backend ``neuron-nxdi`` as one object: plan (``plan.plan_nxdi``: the NeuronConfig/InferenceConfig
keyword arguments) -> compile (NxD Inference's ``compile(dir)`` into one cache entry) -> load (the
application loaded from it, wrapped in ``NxdiRunner``).

Artifacts come from ``option.compiled_graph_path`` when it is an artifact directory
(``neuron_config.json`` + ``model.pt``: loaded as it is, no unit), else from the compile cache. With
``override_neuron_config.on_cpu`` the library's modeling code runs on the CPU (``to_cpu``) and nothing
is compiled or cached. On a miss the application that compiled the entry is the one loaded: the
model is built once per start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compile_cache import CacheKeyInputs
from neuron_lmi.backends import registry
from neuron_lmi.backends.backend import NO_ARTIFACTS, Artifacts, CompileOptions, CompileUnit, load_runner
from neuron_lmi.backends.common import fetch, neuron_compile_cache, rolling_batch_engine, with_model_defaults
from neuron_lmi.backends.host import NXDI, installed_version
from neuron_lmi.backends.nxdi.applications import APPLICATIONS
from neuron_lmi.backends.nxdi.artifacts import is_artifact_dir, new_application, nxdi_key_inputs
from neuron_lmi.backends.nxdi.defaults import apply_environment
from neuron_lmi.backends.nxdi.model_checks import Windows, text_config
from neuron_lmi.backends.nxdi.plan import NxdiPlan, plan_nxdi
from neuron_lmi.backends.nxdi.runner import CausalLMApplication, NxdiRunner, on_cpu_application, runner_for
from neuron_lmi.backends.nxdi.support import PLATFORM_KEY, PLATFORM_VAR, Platform, release, target_platform
from neuron_lmi.config.hf_config import read_hf_config
from neuron_lmi.config.loader import ResolvedConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class NxdiBuildPlan:
    """The mapped plan, the model's ``config.json`` and its cache key; ``units`` is empty where nothing
    is compiled (on the CPU, or a given artifact directory, ``given_dir``)."""

    mapped: NxdiPlan
    model_config: Mapping[str, Any]
    inputs: CacheKeyInputs
    units: tuple[CompileUnit, ...]
    given_dir: Path | None = None
    probe_token = None  # the application runs on NeuronCores (or, on_cpu, is checked by its tier)

    @property
    def n_graphs(self) -> int:
        return len(self.mapped.context_buckets) + len(self.mapped.token_buckets)

    def describe(self) -> dict[str, Any]:
        return {
            **self.mapped.describe(),
            "cache_key": self.inputs.key(),
            "cache_key_inputs": self.inputs.describe(),
        }


def nxdi_target(
    configured_platform: str | None,
    platform_key: str,
    given_version: str | None,
    env: Mapping[str, str],
    compiling: bool = False,
) -> tuple[Platform, str | None, str]:
    """(platform, release or None to infer it from the platform, where the release came from).
    ``compiling`` (a real compile, not a review) refuses a ``--nxdi-version`` other than the installed
    release: the compile runs the installed library."""
    platform = target_platform(configured_platform, env, key=platform_key or PLATFORM_KEY)
    installed = installed_version(NXDI.distribution)
    if given_version:
        if compiling and installed and release(installed) != release(given_version):
            raise ValueError(
                f"--nxdi-version {given_version}: NxD Inference {installed} is installed, and a compile "
                "runs the installed release; drop --nxdi-version or add --dry-run"
            )
        return platform, given_version, "--nxdi-version"
    return platform, installed, "installed"


class NxdiBackend:
    """NxD Inference's backend object (see the module docstring)."""

    name = "neuron-nxdi"

    def __init__(self) -> None:
        # What compile built, by plan, for load to reuse (compile and load run in one process).
        self._compiled: dict[int, Any] = {}

    def plan(
        self, request: registry.BuildRequest, model_path: Path, options: CompileOptions
    ) -> NxdiBuildPlan:
        """The plan for the release and chip: for ``serve``, the release dispatch chose (or the
        installed one) on this host's chip; for ``neuron-lmi compile``, ``--nxdi-version`` and
        ``--platform`` (each with where it came from). ``compiler_version`` keys the entry (default:
        the installed neuronx-cc, ``not-installed`` in a review)."""
        model_config = read_hf_config(model_path, "the NxD Inference backend")
        resolved = positions_within_window(with_model_defaults(request.resolved, model_path), model_config)
        neuron = resolved.config.neuron
        if options.purpose == "serve":
            choice = request.choice
            version = (choice.version if choice else None) or installed_version(NXDI.distribution)
            serving = not neuron.nxdi_on_cpu
            platform = target_platform(neuron.neuron_platform, request.env, serving=serving)
            version, source = (None if version == "unknown version" else version), "installed"
        else:
            key = options.platform_key or resolved.keys.get("neuron_platform", "")
            platform, version, source = nxdi_target(
                neuron.neuron_platform,
                key,
                options.library_version,
                request.env,
                options.purpose == "compile",
            )
        mapped = plan_nxdi(
            resolved.config, model_config, str(model_path), request.tp_degree, version, platform, source
        )
        if mapped.lora is not None and options.purpose == "serve":
            raise ValueError(
                "option.enable_lora: NxD Inference's LoRA serving is mapped (lora_config, shown by "
                "neuron-lmi compile --dry-run) but NxdiRunner does not yet pass each row's adapter "
                "(adapter_ids), and the library's CPU mode cannot run it (docs/lora.md); serve LoRA on "
                "the CPU engine or vLLM"
            )
        inputs = nxdi_key_inputs(mapped, model_config, options.compiler_version, version)
        given = neuron.compiled_graph_path
        given_dir = Path(given) if given and is_artifact_dir(Path(given)) else None
        compiles = not (mapped.on_cpu or given_dir)
        units = (CompileUnit("neuron", inputs),) if compiles else ()
        return NxdiBuildPlan(mapped, model_config, inputs, units, given_dir)

    def compile(self, plan: NxdiBuildPlan, unit: CompileUnit, out: Path) -> None:
        self._prepare(plan)
        app = new_application(plan.mapped, quantized_dir=out / "quantized")
        if plan.mapped.neuron_config.get("quantized"):
            type(app).save_quantized_state_dict(plan.mapped.model_path, app.config)
        app.compile(str(out))
        self._compiled[id(plan)] = app

    def load(
        self, plan: NxdiBuildPlan, artifacts: Artifacts, model: CausalLMApplication | None = None
    ) -> NxdiRunner:
        """The runner over the loaded application (``model`` replaces it: tests pass an
        ``NxdiContractModel``). Without the Neuron SDK this raises ``RuntimeError`` naming the
        packages and AWS's pip repository."""
        mapped = plan.mapped
        _log_plan(mapped)
        if model is None:
            model = self._application(plan, artifacts)
        return runner_for(model, mapped, mapped.vocab_size)

    def _application(self, plan: NxdiBuildPlan, artifacts: Artifacts) -> Any:
        self._prepare(plan)
        if plan.mapped.on_cpu:
            return on_cpu_application(plan.mapped)
        if plan.given_dir is not None:
            log.info("NxD Inference artifacts: %s (given, not cached)", plan.given_dir)
            app = new_application(plan.mapped)
            app.load(str(plan.given_dir))
            return app
        entry = artifacts.entry("neuron")
        done = "compiled now" if "neuron" in artifacts.compiled else "cache hit"
        log.info("NxD Inference artifacts: compile cache entry %s (%s, %s)", entry.key, entry.path, done)
        app = self._compiled.pop(id(plan), None)
        if app is None:
            app = new_application(plan.mapped, quantized_dir=entry.path / "quantized")
        app.load(str(entry.path))
        return app

    def _prepare(self, plan: NxdiBuildPlan) -> None:
        apply_environment(plan.mapped.environment, os.environ)
        if plan.mapped.platform:  # NxD compiles for the chip its variable names
            os.environ.setdefault(PLATFORM_VAR, plan.mapped.platform)

    def engine(self, request: registry.BuildRequest) -> Any:
        """``serve``: fetch, then plan -> compile on a miss -> load, in a rolling-batch engine."""
        path = fetch(request.resolved, request.env)
        resolved = with_model_defaults(request.resolved, path)  # the plan cuts to a window (runner's)
        runner = build_nxdi_runner(dataclasses.replace(request, resolved=resolved), path)
        return rolling_batch_engine(runner, path, resolved, self.name, model_dtype=runner.dtype)


def positions_within_window(resolved: ResolvedConfig, model_config: Mapping[str, Any]) -> ResolvedConfig:
    """LMI's default ``n_positions`` cut to the model's ``sliding_window`` where the
    application serves no more (Gemma 3: ``Windows.WITHIN``, ``model_checks``), logged. A value some
    source set is left for the plan to refuse, naming the key."""
    application = APPLICATIONS.get(str(model_config.get("model_type", "")))
    window = text_config(model_config).get("sliding_window")
    n_positions = resolved.config.batching.n_positions
    default = resolved.source_of("n_positions").startswith("default")
    if application is None or application.windows is not Windows.WITHIN or not isinstance(window, int):
        return resolved
    if not default or n_positions is None or n_positions <= window:
        return resolved
    log.warning(
        "n_positions %d (%s) cut to the model's sliding_window=%d: NxD Inference's %s serves no more "
        "(set option.n_positions to choose another value up to it)",
        n_positions, resolved.source_of("n_positions"), window, application.application,
    )  # fmt: skip
    batching = resolved.config.batching.model_copy(update={"n_positions": window})
    label = f"default:sliding_window={window} (NxD Inference's {application.application})"
    return dataclasses.replace(
        resolved,
        config=resolved.config.model_copy(update={"batching": batching}),
        sources={**resolved.sources, "n_positions": label},
    )


def build_nxdi_runner(
    request: registry.BuildRequest, model_path: str | Path, model: CausalLMApplication | None = None
) -> NxdiRunner:
    """Plan, compile on a miss into ``option.compiled_graph_path``'s store (or the default one; none
    on the CPU or for a given artifact directory), and load; ``model`` replaces the application, and
    then nothing is compiled or loaded (tests pass an ``NxdiContractModel``)."""
    plan = NXDI_BACKEND.plan(request, Path(model_path), CompileOptions())
    if model is not None:
        return NXDI_BACKEND.load(plan, NO_ARTIFACTS, model=model)
    return load_runner(NXDI_BACKEND, plan, neuron_compile_cache(request.resolved) if plan.units else None)


def _log_plan(plan: NxdiPlan) -> None:
    log.info(
        "NxD Inference %s (%s) on %s: %s, %s (%s)%s",
        plan.library_version,
        plan.version_source,
        plan.platform or "an unknown platform",
        plan.application.application,
        plan.dtype,
        plan.dtype_source,
        ", on the CPU (override_neuron_config.on_cpu): a check of the configuration, not a Neuron server"
        if plan.on_cpu
        else "",
    )
    for warning in plan.warnings:
        log.warning("%s", warning)
    for key, reason in plan.ignored.items():
        log.warning("NxD Inference backend ignores %s: %s", key, reason)


NXDI_BACKEND = NxdiBackend()
registry.register_backend(NXDI_BACKEND)
