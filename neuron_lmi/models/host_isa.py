"""What this host's CPU lets compiled code execute: its instruction-set features, and AMX's permission.

Inductor compiles every C++ kernel with ``-march=native`` and, on Intel hosts with AMX, may pick its
AMX micro-GEMMs (``cpp_CppMicroGemmAMX_*``); the native kernels build with ``-march=native`` too. So
a compiled package runs only where every feature of its build host is present, and AMX code only in
a process that asked Linux for the tile state first: a process's first AMX instruction without
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` dies with SIGILL. Inductor asks while it
compiles; a process that only loads a package never does, unless ``request_amx`` runs first.

``isa_features`` is the set a compile-cache key names (``CacheKeyInputs.isa_features``): every
feature flag torch's cpuinfo reports on this host, less AMX's where the kernel refused it (then
Inductor, which asks the same question, emits no AMX either, and the key says so).
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

AMX_FEATURES = frozenset({"amx_tile", "amx_bf16", "amx_int8", "amx_fp16", "amx_complex"})
# torch.cpu.get_capabilities() fields that describe the machine, not an instruction set.
_NOT_FEATURES = frozenset(
    {"architecture", "cpu_name", "num_logical_cores", "num_physical_cores", "num_sockets"}
)

_amx: bool | None = None  # request_amx's answer, once a process
_lock = threading.Lock()


def host_capabilities() -> frozenset[str]:
    """Every instruction-set feature torch's cpuinfo finds on this CPU (``avx2``, ``avx512_bf16``,
    ``amx_tile``, ...), whatever the kernel permits."""
    caps = torch.cpu.get_capabilities()
    return frozenset(name for name, value in caps.items() if value is True and name not in _NOT_FEATURES)


def request_amx() -> bool:
    """Ask Linux once per process for AMX's tile state, before anything runs a compiled package or a
    native kernel. True where AMX may run here; False on a CPU without it, or where the kernel
    refuses (logged once: the compiled graphs then use the AVX-512 path)."""
    global _amx
    with _lock:
        if _amx is None:
            if "amx_tile" not in host_capabilities():
                _amx = False
            else:
                _amx = bool(torch._C._cpu._init_amx())
                if not _amx:
                    log.warning(
                        "this CPU has AMX but the kernel refused its tile state "
                        "(arch_prctl ARCH_REQ_XCOMP_PERM); compiled graphs run without AMX"
                    )
    return _amx


def isa_features() -> tuple[str, ...]:
    """The features compiled code may use in this process, sorted: ``host_capabilities`` less AMX's
    where ``request_amx`` was refused."""
    features = host_capabilities()
    if not request_amx():
        features -= AMX_FEATURES
    return tuple(sorted(features))
