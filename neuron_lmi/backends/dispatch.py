"""Pick the backend that serves a model on this host, and the tensor-parallel degree it runs at.

Backends (the names the builder registry is keyed by, ``neuron_lmi.backends.registry``)::

    cpu          the torch reference engine
    neuron-nxdi  NxD Inference (neuronx-distributed-inference), Neuron SDK 2.21 and later
    neuron-tnx   transformers-neuronx, for hosts on Neuron SDK <= 2.25 (end of support in 2.26)
    vllm         vLLM on CUDA (or a CPU build of vLLM, when asked for)
    vllm-neuron  vLLM with the vllm-neuron platform plugin (NxD Inference underneath)

The decision is a pure function of what was asked for and what the host has, so it is tested with
hand-made probes; only ``probe_host`` looks at the real machine, and it never raises.

    requested  host                            -> backend
    auto       Neuron devices                  -> neuron (below)
               CUDA GPUs and vLLM installed    -> vllm
               otherwise                       -> cpu
    neuron     Neuron devices; option.model_loader picks the library: nxdi | tnx | vllm
               (vllm -> vllm-neuron); unset -> NxD Inference when it imports, else
               transformers-neuronx; neither -> BackendUnavailableError naming both packages;
               NxD Inference 0.9+ on inf2/trn1 -> refused, naming SDK 2.28 (nxdi.support)
               no devices, override_neuron_config.on_cpu -> neuron-nxdi on the CPU (NxD
               Inference's own modeling code, a configuration check)
    vllm       Neuron devices -> vllm-neuron (never the CUDA path); else CUDA or vLLM's CPU build
    cpu        cpu

``neuron_lmi.backends.host`` looks at the machine (``probe_host``) without initialising CUDA.

LMI's selectors reach ``choose_backend`` through ``requested_from_lmi``: ``option.rolling_batch``
(``vllm``/``lmi-dist`` -> vllm, ``tnx``/``neuronx`` -> neuron, ``auto``/``disable``/``scheduler`` ->
auto) and ``engine`` (``Python``/``MPI`` choose LMI's process model, not the backend: validated only).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from neuron_lmi.backends import registry
from neuron_lmi.backends.host import (
    NEURON_LIBRARIES,
    NXDI,
    TNX,
    VLLM_NEURON,
    BackendProbe,
    cuda_device_count,
    parse_core_list,
    probe_host,
    visible_gpu_count,
    visible_neuron_cores,
)
from neuron_lmi.backends.nxdi.support import UnsupportedReleaseError, check_release
from neuron_lmi.config.options import BACKEND_REQUESTS, ROLLING_BATCH_REQUESTS

__all__ = [
    "BACKEND_NAMES",
    "NEURON_LIBRARIES",
    "BackendChoice",
    "BackendProbe",
    "BackendUnavailableError",
    "choose_backend",
    "cuda_device_count",
    "parse_core_list",
    "probe_host",
    "requested_from_lmi",
    "resolve_tp_degree",
    "visible_gpu_count",
    "visible_neuron_cores",
]

log = logging.getLogger(__name__)

REQUESTS = BACKEND_REQUESTS  # what --backend accepts
BACKENDS = REQUESTS  # (kept under its old name)
BACKEND_NAMES = tuple(sorted(registry.BUILTIN_MODULES))  # the registry's names, listed there once
NEURON_BACKENDS = ("neuron-nxdi", "neuron-tnx", "vllm-neuron")
MODEL_LOADERS = ("nxdi", "tnx", "vllm")
NEURON_PIP_REPOSITORY = "https://pip.repos.neuron.amazonaws.com"


# option.rolling_batch value -> requested backend: the configuration's one table.
ROLLING_BATCH_TO_BACKEND = ROLLING_BATCH_REQUESTS
LMI_ENGINES = ("python", "mpi")

NO_NEURON_LIBRARY = (
    "neither Neuron library imports: neuronx-distributed-inference (NxD Inference, Neuron SDK 2.21 "
    "and later) nor transformers-neuronx (Neuron SDK <= 2.25). Both come from AWS's Neuron pip "
    f"repository, not PyPI: pip install --extra-index-url {NEURON_PIP_REPOSITORY} "
    "neuronx-distributed-inference (or use a Neuron Deep Learning AMI or container, which has it)"
)


class BackendUnavailableError(RuntimeError):
    """A requested backend cannot run on this host; the message names what is missing."""


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """The backend to build, the library behind it and its version, and why (for the start-up log)."""

    name: str
    reason: str
    library: str | None = None
    version: str | None = None

    def summary(self) -> str:
        lib = f" on {self.library} {self.version or ''}".rstrip() if self.library else ""
        return f"backend {self.name}{lib}: {self.reason}"


def _neuron_choice(
    probe: BackendProbe, model_loader: str | None, why: str, allow_unsupported_platform: bool = False
) -> BackendChoice:
    """A Neuron host: the library named by ``option.model_loader``, else NxD Inference, else tnx."""
    found = probe.describe()
    if model_loader == "vllm":
        return _vllm_neuron_choice(probe, f"{why}, option.model_loader=vllm")
    if model_loader == "nxdi" or (model_loader is None and probe.nxdi_version):
        _check_nxdi_release(probe, allow_unsupported_platform)
        if not probe.nxdi_version:
            raise BackendUnavailableError(
                f"backend 'neuron-nxdi' (option.model_loader=nxdi) cannot run here: {NXDI.distribution} "
                f"does not import; install it from AWS's Neuron pip repository ({NEURON_PIP_REPOSITORY}); "
                f"host: {found}"
            )
        because = "option.model_loader=nxdi" if model_loader else "NxD Inference imports"
        reason = f"{why}, {because}; host: {found}"
        return BackendChoice("neuron-nxdi", reason, NXDI.distribution, probe.nxdi_version)
    if model_loader == "tnx" or probe.tnx_version:
        if not probe.tnx_version:
            raise BackendUnavailableError(
                f"backend 'neuron-tnx' (option.model_loader=tnx) cannot run here: {TNX.distribution} "
                f"does not import (it ships with Neuron SDK <= 2.25, from {NEURON_PIP_REPOSITORY}); "
                f"host: {found}"
            )
        because = (
            "option.model_loader=tnx"
            if model_loader
            else "transformers-neuronx imports and NxD Inference does not (Neuron SDK <= 2.25)"
        )
        reason = f"{why}, {because}; host: {found}"
        return BackendChoice("neuron-tnx", reason, TNX.distribution, probe.tnx_version)
    raise BackendUnavailableError(
        f"this host has {probe.neuron_devices} Neuron devices but {NO_NEURON_LIBRARY}; host: {found}"
    )


def _check_nxdi_release(probe: BackendProbe, allow_unsupported_platform: bool) -> None:
    """The SDK matrix; where ``option.allow_unsupported_nxdi_on_inf2_trn1`` lets 0.9+ through on
    inf2/trn1, the plan logs the warning at start-up."""
    try:
        check_release(probe.nxdi_version, probe.neuron_platform, None, allow_unsupported_platform)
    except UnsupportedReleaseError as exc:
        raise BackendUnavailableError(f"backend 'neuron-nxdi' cannot run here: {exc}") from exc


def _nxdi_on_cpu_choice(
    probe: BackendProbe, why: str, allow_unsupported_platform: bool = False
) -> BackendChoice:
    """NxD Inference's modeling code on the CPU (``NeuronConfig(on_cpu=True)``, ``to_cpu()``)."""
    if not probe.nxdi_version:
        raise BackendUnavailableError(
            f"backend 'neuron-nxdi' on the CPU (override_neuron_config.on_cpu) needs {NXDI.distribution} "
            f"and its Neuron packages installed (pip install --extra-index-url {NEURON_PIP_REPOSITORY} "
            f"{NXDI.distribution}); it does not import; host: {probe.describe()}"
        )
    _check_nxdi_release(probe, allow_unsupported_platform)
    reason = (
        f"{why}, override_neuron_config.on_cpu=true: NxD Inference's modeling code on the CPU, no "
        f"Neuron devices used (a check of the configuration, not a server for traffic); host: "
        f"{probe.describe()}"
    )
    return BackendChoice("neuron-nxdi", reason, NXDI.distribution, probe.nxdi_version)


def _vllm_neuron_choice(probe: BackendProbe, why: str) -> BackendChoice:
    missing = []
    if not probe.vllm_importable:
        missing.append("vLLM is not installed")
    if not probe.vllm_neuron_version:
        missing.append(f"{VLLM_NEURON.distribution} does not import (github.com/vllm-project/vllm-neuron)")
    if not probe.nxdi_version:
        missing.append(f"{NXDI.distribution} does not import (vllm-neuron runs on NxD Inference)")
    if missing:
        raise BackendUnavailableError(
            f"backend 'vllm-neuron' cannot run here: {'; '.join(missing)}; install them with "
            f"pip install --extra-index-url {NEURON_PIP_REPOSITORY} (see vllm-neuron's README); "
            f"host: {probe.describe()}"
        )
    reason = f"{why}; host: {probe.describe()}"
    return BackendChoice("vllm-neuron", reason, VLLM_NEURON.distribution, probe.vllm_neuron_version)


def _vllm_missing(probe: BackendProbe) -> list[str]:
    if not probe.vllm_importable:
        return ["vLLM does not import (pip install vllm on a CUDA host)"]
    if probe.cuda_available or probe.vllm_platform == "cpu":
        return []
    return [f"no CUDA device, and this vLLM build targets {probe.vllm_platform or 'an unknown platform'}"]


def choose_backend(
    requested: str,
    probe: BackendProbe,
    model_loader: str | None = None,
    nxdi_on_cpu: bool = False,
    allow_unsupported_platform: bool = False,
) -> BackendChoice:
    """The backend for ``requested`` (auto|cpu|neuron|vllm) and LMI's ``option.model_loader``
    (nxdi|tnx|vllm|None) on a host described by ``probe``; ``nxdi_on_cpu`` is
    ``override_neuron_config.on_cpu``, ``allow_unsupported_platform``
    ``option.allow_unsupported_nxdi_on_inf2_trn1``. Raises ``BackendUnavailableError``."""
    req = (requested or "auto").strip().lower()
    if req not in REQUESTS:
        raise ValueError(f"backend must be one of {', '.join(REQUESTS)}, got {requested!r}")
    loader = model_loader.strip().lower() if model_loader else None
    if loader is not None and loader not in MODEL_LOADERS:
        choices = ", ".join(MODEL_LOADERS)
        raise ValueError(f"option.model_loader must be one of {choices}, got {model_loader!r}")
    found = probe.describe()
    if req == "cpu":
        return BackendChoice("cpu", f"forced by request; host: {found}")
    if req == "vllm" and probe.neuron_devices_present:
        if loader == "tnx":
            raise ValueError(
                "option.rolling_batch=vllm with option.model_loader=tnx: vLLM on Neuron runs on NxD "
                "Inference only (the vllm-neuron plugin); drop model_loader or set it to nxdi"
            )
        return _vllm_neuron_choice(probe, "forced vllm on a Neuron host: vLLM with the vllm-neuron plugin")
    if req == "vllm":
        missing = _vllm_missing(probe)
        if missing:
            raise BackendUnavailableError(f"backend 'vllm' cannot run here: {'; '.join(missing)}")
        return BackendChoice("vllm", f"forced by request; host: {found}", "vllm")
    on_cpu = nxdi_on_cpu and not probe.neuron_devices_present and loader in (None, "nxdi")
    if on_cpu and (req == "neuron" or (req == "auto" and loader == "nxdi")):
        why = "forced neuron" if req == "neuron" else "option.model_loader=nxdi"
        return _nxdi_on_cpu_choice(probe, f"{why} without Neuron devices", allow_unsupported_platform)
    if req == "neuron":
        if not probe.neuron_devices_present:
            raise BackendUnavailableError(
                f"backend 'neuron' cannot run here: no Neuron devices (/dev/neuron*); host: {found}"
            )
        return _neuron_choice(probe, loader, "forced neuron", allow_unsupported_platform)
    if probe.neuron_devices_present:
        return _neuron_choice(probe, loader, "auto: Neuron devices found", allow_unsupported_platform)
    note = f" (option.model_loader={loader} ignored: no Neuron devices)" if loader else ""
    if probe.cuda_available and probe.vllm_importable:
        return BackendChoice("vllm", f"auto: CUDA GPUs and vLLM found{note}; host: {found}", "vllm")
    return BackendChoice("cpu", f"auto: neither Neuron nor CUDA+vLLM usable{note}; host: {found}")


def requested_from_lmi(
    backend: str | None = None, rolling_batch: str | None = None, engine: str | None = None
) -> str:
    """Fold ``--backend`` and LMI's ``option.rolling_batch`` / ``engine`` into one request.

    An explicit ``--backend`` other than auto wins; a conflicting explicit ``option.rolling_batch``
    is an error rather than a silent override.
    """
    if engine is not None and str(engine).strip().lower() not in LMI_ENGINES:
        raise ValueError(f"engine must be Python or MPI, got {engine!r}")
    from_rb = "auto"
    if rolling_batch is not None:
        key = str(rolling_batch).strip().lower()
        if key not in ROLLING_BATCH_TO_BACKEND:
            raise ValueError(
                f"option.rolling_batch must be one of {', '.join(sorted(ROLLING_BATCH_TO_BACKEND))}, "
                f"got {rolling_batch!r}"
            )
        from_rb = ROLLING_BATCH_TO_BACKEND[key]
    req = (backend or "auto").strip().lower()
    if req not in REQUESTS:
        raise ValueError(f"backend must be one of {', '.join(REQUESTS)}, got {backend!r}")
    if req != "auto" and from_rb != "auto" and req != from_rb:
        raise ValueError(
            f"--backend {req} conflicts with option.rolling_batch={rolling_batch} (which selects {from_rb})"
        )
    return req if req != "auto" else from_rb


# -- tensor_parallel_degree=max ------------------------------------------------------------------


def resolve_tp_degree(
    tensor_parallel_degree: int | str,
    backend: str,
    probe: BackendProbe,
    env: Mapping[str, str],
    logical_nc_config: int | None = None,
    nxdi_on_cpu: bool = False,
) -> tuple[int, str]:
    """The degree to run at and how it was found; ``max`` means every visible NeuronCore on the
    Neuron backends, every visible GPU on vLLM, and 1 on the CPU engine and in NxD Inference's CPU
    mode (one rank in this process)."""
    if tensor_parallel_degree != "max":
        return int(tensor_parallel_degree), "configured"
    if nxdi_on_cpu and not probe.neuron_devices_present:
        return 1, "max: NxD Inference's CPU mode runs one rank"
    if backend in NEURON_BACKENDS:
        lnc = logical_nc_config or _positive_int(env.get("NEURON_LOGICAL_NC_CONFIG"))
        cores = visible_neuron_cores(
            env.get("NEURON_RT_VISIBLE_CORES"),
            probe.neuron_devices,
            probe.neuron_cores_per_device,
            lnc,
            env.get("NEURON_RT_NUM_CORES"),
        )
        if cores < 1:
            raise BackendUnavailableError("tensor_parallel_degree=max: no NeuronCores are visible")
        where = (
            f"NEURON_RT_VISIBLE_CORES={env['NEURON_RT_VISIBLE_CORES']}"
            if env.get("NEURON_RT_VISIBLE_CORES", "").strip()
            else f"{probe.neuron_devices} devices x {probe.neuron_cores_per_device} cores"
        )
        return cores, f"max: visible NeuronCores ({where})"
    if backend == "vllm":
        return max(1, probe.cuda_devices), f"max: {probe.cuda_devices} visible CUDA GPUs"
    return 1, "max: the CPU engine runs one rank"


def _positive_int(value: str | None) -> int | None:
    return int(value) if value and value.strip().isdigit() and int(value) > 0 else None
