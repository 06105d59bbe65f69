"""What this host offers for serving: Neuron devices and libraries, CUDA GPUs, vLLM, visible cores.

``probe_host`` is the only function here that looks at the real machine, and it never raises: a
failed check becomes a note in the probe. It never initialises CUDA in this process (vLLM forks its
engine core, and a parent that has touched CUDA leaves a child that cannot use it): GPUs are counted
through NVML (``nvidia-ml-py``, as vLLM's ``cuda_platform_plugin`` does) or, without it, the
``/dev/nvidia<N>`` device nodes, then restricted by ``CUDA_VISIBLE_DEVICES``; ``torch.cuda`` is never
called, and vLLM is imported only when it is forced on a host without GPUs (a CPU build of vLLM
reports its platform that way). Each Neuron library is probed by its own import, and only on a host
with Neuron devices. The rest are pure functions of their arguments.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from neuron_lmi.backends.nxdi.support import target_platform

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Library:
    """A Python package probed by importing it: import name, distribution name, what to call it."""

    module: str
    distribution: str
    title: str


NXDI = Library("neuronx_distributed_inference", "neuronx-distributed-inference", "NxD Inference")
TNX = Library("transformers_neuronx", "transformers-neuronx", "transformers-neuronx")
VLLM_NEURON = Library("vllm_neuron", "vllm-neuron", "the vllm-neuron plugin")
NEURON_LIBRARIES = (NXDI.module, TNX.module)


@dataclass(frozen=True, slots=True)
class BackendProbe:
    """What the host offers. A library's ``*_version`` is None when it does not import (or was not
    probed: Neuron libraries are probed only on a host with Neuron devices). ``vllm_platform`` is
    the device vLLM would pick ("cuda", "cpu", ...) when known."""

    neuron_devices: int = 0
    neuron_cores_per_device: int = 2
    nxdi_version: str | None = None
    tnx_version: str | None = None
    vllm_neuron_version: str | None = None
    cuda_devices: int = 0
    vllm_importable: bool = False
    vllm_platform: str | None = None
    neuron_platform: str | None = None  # inf2 | trn1 | trn2 | ... (nxdi.support.host_platform)
    notes: tuple[str, ...] = field(default=())

    @property
    def neuron_devices_present(self) -> bool:
        return self.neuron_devices > 0

    @property
    def cuda_available(self) -> bool:
        return self.cuda_devices > 0

    def describe(self) -> str:
        def lib(title: str, version: str | None) -> str:
            return f"{title} {version}" if version else f"{title} not importable"

        neuron = f"{self.neuron_devices} Neuron devices"
        if self.neuron_devices:
            neuron += f" ({self.neuron_cores_per_device} cores each); " + "; ".join(
                lib(t, v)
                for t, v in (
                    (NXDI.distribution, self.nxdi_version),
                    (TNX.distribution, self.tnx_version),
                    (VLLM_NEURON.distribution, self.vllm_neuron_version),
                )
            )
        vllm = (
            f"vLLM installed (platform {self.vllm_platform or 'unknown'})"
            if self.vllm_importable
            else "vLLM not installed"
        )
        return "; ".join([neuron, f"{self.cuda_devices} CUDA GPUs", vllm, *self.notes])


def parse_core_list(value: str) -> tuple[int, ...]:
    """``NEURON_RT_VISIBLE_CORES``: ``"0-7"``, ``"0,1,2"`` or a mix (``"0-3,8-11"``) -> sorted cores."""
    cores: set[int] = set()
    for part in value.split(","):
        text = part.strip()
        first, dash, last = text.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"NEURON_RT_VISIBLE_CORES={value!r}: expected core ids like 0-7 or 0,1,2")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo:
            raise ValueError(f"NEURON_RT_VISIBLE_CORES={value!r}: range {text} runs backwards")
        cores.update(range(lo, hi + 1))
    return tuple(sorted(cores))


def visible_neuron_cores(
    visible_cores: str | None,
    device_count: int,
    cores_per_device: int = 2,
    logical_nc_config: int | None = None,
    num_cores: str | None = None,
) -> int:
    """NeuronCores this process may use: ``NEURON_RT_VISIBLE_CORES`` when set (already in logical
    cores), else ``NEURON_RT_NUM_CORES``, else ``device_count x cores_per_device`` divided by the
    logical NeuronCore size (trn2's 8 physical cores per device pair up by default: LNC=2)."""
    if visible_cores is not None and visible_cores.strip():
        return len(parse_core_list(visible_cores))
    if num_cores is not None and num_cores.strip():
        if not num_cores.strip().isdigit() or int(num_cores) < 1:
            raise ValueError(f"NEURON_RT_NUM_CORES={num_cores!r}: expected a positive integer")
        return int(num_cores)
    lnc = logical_nc_config or (2 if cores_per_device == 8 else 1)
    return device_count * cores_per_device // lnc


def visible_gpu_count(physical: int, cuda_visible_devices: str | None) -> int:
    """GPUs a CUDA process would see: ``CUDA_VISIBLE_DEVICES`` lists ordinals or UUIDs and, as CUDA
    does, the list ends at the first entry that names no device; unset means all of them."""
    if cuda_visible_devices is None:
        return physical
    count = 0
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if (entry.isdigit() and int(entry) < physical) or entry.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break
    return min(count, physical)


def _nvml_device_count() -> int | None:
    """GPUs seen by NVML (``nvidia-ml-py``), which never creates a CUDA context; None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: no NVIDIA driver here
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


def cuda_device_count(env: Mapping[str, str], nvidia_glob: str = "/dev/nvidia[0-9]*") -> tuple[int, str]:
    """Visible CUDA GPUs and how they were counted, without initialising CUDA (no ``torch.cuda``)."""
    nvml = _nvml_device_count()
    physical, how = (nvml, "NVML") if nvml is not None else (len(glob.glob(nvidia_glob)), "device nodes")
    return visible_gpu_count(physical, env.get("CUDA_VISIBLE_DEVICES")), how


def installed_version(distribution: str) -> str | None:
    """``distribution``'s installed version, read from its metadata (nothing is imported); None
    where it is not installed. Compile-cache keys and the start-up log read versions through this."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _library_version(library: Library) -> str | None:
    """The installed version when ``library`` imports, else None (an import error propagates)."""
    if importlib.util.find_spec(library.module) is None:
        return None
    module = importlib.import_module(library.module)
    # A source tree on sys.path has no distribution metadata; its own __version__ still tells.
    version = installed_version(library.distribution) or getattr(module, "__version__", None)
    return version or "unknown version"


def _cores_per_device(sysfs_root: str) -> int:
    """``/sys/devices/virtual/neuron_device/neuron0/core_count``; 2 (inf2/trn1) when unreadable."""
    path = Path(sysfs_root) / "neuron0" / "core_count"
    text = path.read_text(encoding="ascii").strip() if path.is_file() else ""
    return int(text) if text.isdigit() and int(text) > 0 else 2


def _vllm_platform(requested: str, gpus: int) -> str | None:
    """vLLM's platform, judged as its own detection does (NVML count, a "cpu" build) without
    importing vLLM; only a forced vLLM on a GPU-less host imports it, to read a CPU build's platform."""
    version = installed_version("vllm") or ""
    if "cpu" in version:
        return "cpu"
    if gpus > 0:
        return "cuda"
    if requested == "vllm":
        # vLLM forks its engine core unless told otherwise; say spawn before its first import, as its
        # own CLI does (the user's explicit choice wins).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm.platforms import current_platform

        return str(current_platform.device_type)
    return None


def _safe(check, default, notes: list[str], what: str):
    try:
        return check()
    except Exception as exc:  # a probe must never stop start-up; say what failed instead
        notes.append(f"{what} check failed: {type(exc).__name__}: {exc}")
        return default


def probe_host(
    requested: str = "auto",
    dev_glob: str = "/dev/neuron[0-9]*",
    env: Mapping[str, str] | None = None,
    nvidia_glob: str = "/dev/nvidia[0-9]*",
    sysfs_root: str = "/sys/devices/virtual/neuron_device",
    nxdi_on_cpu: bool = False,
    neuron_platform: str | None = None,
) -> BackendProbe:
    """Look at this host. Neuron libraries are imported only where Neuron devices are present, or
    NxD Inference alone where its CPU mode is asked for (``nxdi_on_cpu``). ``neuron_platform``
    (``option.neuron_platform``) names the chip where NxD's override and the instance type do not."""
    env = os.environ if env is None else env
    req = (requested or "auto").strip().lower()
    notes: list[str] = []
    devices = len(glob.glob(dev_glob))
    cores, versions = 2, {NXDI: None, TNX: None, VLLM_NEURON: None}
    if devices:
        cores = _safe(lambda: _cores_per_device(sysfs_root), 2, notes, "NeuronCores per device")
    for lib in versions:
        if devices or (nxdi_on_cpu and lib is NXDI):
            versions[lib] = _safe(lambda lib=lib: _library_version(lib), None, notes, lib.distribution)
    gpus, how = _safe(lambda: cuda_device_count(env, nvidia_glob), (0, "failed"), notes, "CUDA")
    if gpus:
        notes.append(f"GPUs counted by {how}")
    vllm_ok = importlib.util.find_spec("vllm") is not None
    platform = None
    if vllm_ok and not devices:
        failed = len(notes)
        platform = _safe(lambda: _vllm_platform(req, gpus), None, notes, "vLLM import")
        vllm_ok = len(notes) == failed  # installed but broken is not importable
    probe = BackendProbe(
        neuron_devices=devices,
        neuron_cores_per_device=cores,
        nxdi_version=versions[NXDI],
        tnx_version=versions[TNX],
        vllm_neuron_version=versions[VLLM_NEURON],
        cuda_devices=gpus,
        vllm_importable=vllm_ok,
        vllm_platform=platform,
        neuron_platform=_safe(
            lambda: target_platform(neuron_platform, env, serving=not nxdi_on_cpu).name,
            neuron_platform,
            notes,
            "platform",
        ),
        notes=tuple(notes),
    )
    log.debug("host probe: %s", probe.describe())
    return probe
