"""Pick the backend that serves a model on this host: ``neuron``, ``vllm`` or ``cpu``.

The decision is a pure function of what was asked for and what the host has, so it is tested with
hand-made probes; only ``probe_host`` looks at the real machine, and it never raises.

    auto   -> neuron  when Neuron devices are present and the Neuron library imports
           -> vllm    when CUDA is available and vLLM imports
           -> cpu     otherwise (the torch reference engine)
    forced -> that backend, or ``BackendUnavailableError`` naming what is missing

LMI's selectors reach the same function through ``requested_from_lmi``: ``option.rolling_batch``
(``vllm``/``lmi-dist`` -> vllm, ``tnx`` -> neuron, ``auto``/``disable``/``scheduler`` -> auto) and
``engine`` (``Python``/``MPI`` choose LMI's process model, not the backend, so they only validate).
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "neuron", "vllm")
NEURON_LIBRARIES = ("transformers_neuronx", "neuronx_distributed_inference")

# option.rolling_batch value -> requested backend. "disable" keeps continuous batching on (it is
# the only mode this project has) and lets the host decide; TensorRT-LLM has no equivalent here.
ROLLING_BATCH_TO_BACKEND = {
    "auto": "auto",
    "disable": "auto",
    "scheduler": "auto",
    "vllm": "vllm",
    "lmi-dist": "vllm",
    "tnx": "neuron",
    "neuronx": "neuron",
}
LMI_ENGINES = ("python", "mpi")


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run on this host; the message names what is missing."""


@dataclass(frozen=True, slots=True)
class BackendProbe:
    """What the host offers. ``vllm_platform`` is vLLM's device type ("cuda", "cpu", ...) when it imports."""

    neuron_devices_present: bool = False
    neuron_library_importable: bool = False
    cuda_available: bool = False
    vllm_importable: bool = False
    vllm_platform: str | None = None
    notes: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        parts = [
            f"neuron devices {'present' if self.neuron_devices_present else 'absent'}",
            f"neuron library {'importable' if self.neuron_library_importable else 'not importable'}",
            f"CUDA {'available' if self.cuda_available else 'unavailable'}",
            "vLLM "
            + (
                f"importable (platform {self.vllm_platform or 'unknown'})"
                if self.vllm_importable
                else "not importable"
            ),
        ]
        return "; ".join(parts + list(self.notes))


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """The backend to build and a one-line reason for the start-up log."""

    name: str
    reason: str


def _neuron_missing(probe: BackendProbe) -> list[str]:
    missing = []
    if not probe.neuron_devices_present:
        missing.append("no Neuron devices (/dev/neuron*)")
    if not probe.neuron_library_importable:
        missing.append(f"no importable Neuron library ({' or '.join(NEURON_LIBRARIES)})")
    return missing


def _vllm_missing(probe: BackendProbe) -> list[str]:
    if not probe.vllm_importable:
        return ["vLLM does not import (pip install vllm on a CUDA host)"]
    if probe.cuda_available or probe.vllm_platform == "cpu":
        return []
    return [f"no CUDA device, and this vLLM build targets {probe.vllm_platform or 'an unknown platform'}"]


def choose_backend(requested: str, probe: BackendProbe) -> BackendChoice:
    """The backend for ``requested`` (auto|cpu|neuron|vllm) on a host described by ``probe``."""
    req = (requested or "auto").strip().lower()
    if req not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    found = probe.describe()
    if req == "cpu":
        return BackendChoice("cpu", f"forced by request; host: {found}")
    if req == "neuron":
        missing = _neuron_missing(probe)
        if missing:
            raise BackendUnavailableError(f"backend 'neuron' cannot run here: {'; '.join(missing)}")
        return BackendChoice("neuron", f"forced by request; host: {found}")
    if req == "vllm":
        missing = _vllm_missing(probe)
        if missing:
            raise BackendUnavailableError(f"backend 'vllm' cannot run here: {'; '.join(missing)}")
        return BackendChoice("vllm", f"forced by request; host: {found}")
    if not _neuron_missing(probe):
        return BackendChoice("neuron", f"auto: Neuron devices and library found; host: {found}")
    if probe.cuda_available and probe.vllm_importable:
        return BackendChoice("vllm", f"auto: CUDA available and vLLM imports; host: {found}")
    return BackendChoice("cpu", f"auto: neither Neuron nor CUDA+vLLM usable; host: {found}")


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
    if req not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if req != "auto" and from_rb != "auto" and req != from_rb:
        raise ValueError(
            f"--backend {req} conflicts with option.rolling_batch={rolling_batch} (which selects {from_rb})"
        )
    return req if req != "auto" else from_rb


def _safe(check, default, notes: list[str], what: str):
    try:
        return check()
    except Exception as exc:  # a probe must never stop start-up; say what failed instead
        notes.append(f"{what} check failed: {type(exc).__name__}: {exc}")
        return default


def _neuron_library_importable() -> bool:
    for name in NEURON_LIBRARIES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
            return True
    return False


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _vllm_platform() -> str:
    vllm = importlib.import_module("vllm")
    del vllm
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def probe_host(requested: str = "auto", dev_glob: str = "/dev/neuron*") -> BackendProbe:
    """Look at this host. vLLM is imported (seconds) only when it could be chosen: CUDA or forced."""
    notes: list[str] = []
    devices = bool(glob.glob(dev_glob))
    neuron_lib = devices and _safe(_neuron_library_importable, False, notes, "Neuron library")
    if not devices:
        notes.append("Neuron library not checked (no devices)")
    cuda = _safe(_cuda_available, False, notes, "CUDA")
    vllm_ok, platform = False, None
    if importlib.util.find_spec("vllm") is None:
        pass
    elif cuda or requested.strip().lower() == "vllm":
        platform = _safe(_vllm_platform, None, notes, "vLLM import")
        vllm_ok = platform is not None
    else:
        notes.append("vLLM installed but not imported (no CUDA)")
    probe = BackendProbe(devices, bool(neuron_lib), cuda, vllm_ok, platform, tuple(notes))
    log.debug("host probe: %s", probe.describe())
    return probe
