"""fp32 GEMMs on packed weights inside the compiled graphs: ``torch.ops.neuron_lmi.mkl_linear`` and
``torch.ops.neuron_lmi.onednn_linear``.

A decode step multiplies a few rows by every weight, and the weights stream from memory. The ATen
``mm`` an fp32 AOTInductor package calls on its frozen weights is MKL's plain SGEMM, which re-blocks
the weight on every call. A weight blocked once, in MKL's packed layout (``cblas_sgemm_pack``, which
torch exposes as ``mkl::_mkl_linear``) or in oneDNN's (``mkldnn::_linear_pointwise``), runs those
shapes faster; which of the two depends on the CPU (``python -m bench.packed_linear``; figures in
docs/measurements.md): MKL runs its AVX-512 kernels on Intel CPUs only; on others oneDNN's are more
than twice as fast.
``host_library`` picks by the CPU's vendor (``NEURON_LMI_PACKED_GEMM`` overrides it).

Inductor uses packed GEMMs itself in JIT mode only: in an AOT package a pack cannot be a constant
(MKL keeps address-dependent metadata in it, oneDNN's is an opaque tensor), and its lowering wants a
static row count. These ops take the plain weight, which the package freezes as usual, and pack it
on first use in this process: one pack per weight storage and library, reused by every row count
(MKL's packed layout does not depend on the rows, and ``mkl::_mkl_linear`` is told the actual count,
so it never falls back to ``F.linear``; oneDNN's is chosen for ``PACK_ROWS`` and runs any count).
Results differ from ``F.linear`` in the last bits only (another summation order; greedy ids stayed
the eager engine's: ``tests/backends/cpu/test_compiled_graphs.py``).

Inside a package, AOTInductor's proxy executor calls an op through the dispatcher. The kernels are
native (``packed_linear.cpp``, built on first use with the other ops' kernels: ``models.native``):
a Python kernel's per-call cost there, over a step's hundred-odd GEMMs, made a one-row step slower
than ATen's. Where the build fails (no C++ compiler) the Python kernels below run
instead, with a warning. Importing this module defines the ops and their fake kernels, all that
tracing (``tracing_packed_linears``) needs; ``kernel()`` registers their CPU kernels, which opening a
package (``backends.cpu.aot.load_package``) does first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from neuron_lmi.models import native
from neuron_lmi.models.quant import dense_linear_kernel

LIBRARIES = ("mkl", "onednn")
DTYPES = {"mkl": (torch.float32,), "onednn": (torch.float32, torch.bfloat16)}  # the weights each packs
PACK_ROWS = 32  # what a pack is made for; any row count runs on it (as in packed_linear.cpp)
LIBRARY_ENV = "NEURON_LMI_PACKED_GEMM"  # "mkl", "onednn" or "aten" (no op): instead of the vendor rule

_library = torch.library.Library("neuron_lmi", "FRAGMENT")
for _name in LIBRARIES:
    _library.define(f"{_name}_linear(Tensor x, Tensor weight) -> Tensor")

    @torch.library.register_fake(f"neuron_lmi::{_name}_linear", lib=_library)
    def _linear_shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], weight.shape[0])


def op_name(library: str) -> str:
    """The op that multiplies on ``library``'s packs: ``neuron_lmi::mkl_linear`` or ``onednn_linear``."""
    return f"neuron_lmi::{library}_linear"


def available(library: str) -> bool:
    """Whether this torch build has ``library``'s packed GEMM (x86 builds have both)."""
    if library == "mkl":
        return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_linear")
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``), or "" where it cannot be read."""
    return native.cpuinfo_field("vendor_id", cpuinfo)


def host_library(vendor: str | None = None) -> str | None:
    """The packed GEMM the compiled graphs call on this host (fp32; bf16 too where it is oneDNN's:
    ``backends.cpu.compiled_decode.packed_gemm_library``): MKL on Intel CPUs, oneDNN on the others
    (see the table above); None where neither is there. ``NEURON_LMI_PACKED_GEMM`` overrides the
    rule (``aten``: None, what Inductor picks itself)."""
    forced = os.environ.get(LIBRARY_ENV)
    if forced:
        if forced == "aten":
            return None
        choices = [library for library in LIBRARIES if available(library)] + ["aten"]
        if forced not in choices:
            raise ValueError(f"{LIBRARY_ENV}={forced!r}: expected one of {', '.join(choices)}")
        return forced
    vendor = cpu_vendor() if vendor is None else vendor
    order = ("mkl", "onednn") if vendor == "GenuineIntel" else ("onednn", "mkl")
    return next((library for library in order if available(library)), None)


def register_python_kernels() -> None:
    """The Python kernels, where the native ones did not build (``ops.kernels`` calls this)."""
    for library in LIBRARIES:
        _library.impl(f"{library}_linear", _python_kernel(library), "CPU")


# The Python kernels. (weight.data_ptr(), library) -> (a weak reference to its storage, its layout,
# the pack): a storage that died may have its address reused by another weight, and a transposed
# view shares the address of what it views, so only a live storage with the same shape and strides
# reuses a pack.
_packs: dict[tuple[int, str], tuple[StorageWeakRef, tuple[tuple[int, ...], ...], torch.Tensor]] = {}
_packs_lock = threading.Lock()


def _make_pack(weight: torch.Tensor, library: str) -> torch.Tensor:
    if library == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), PACK_ROWS)
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


def _packed(weight: torch.Tensor, library: str) -> torch.Tensor:
    key, layout = (weight.data_ptr(), library), (tuple(weight.shape), weight.stride())
    hit = _packs.get(key)
    if hit is not None and not hit[0].expired() and hit[1] == layout:
        return hit[2]
    for stale in [k for k, (ref, _, _) in _packs.items() if ref.expired()]:
        del _packs[stale]
    pack = _make_pack(weight, library)
    _packs[key] = (StorageWeakRef(weight.untyped_storage()), layout, pack)
    return pack


def _python_kernel(library: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        with _packs_lock:
            pack = _packed(weight, library)
        if library == "mkl":
            out = torch.ops.mkl._mkl_linear.default(rows, pack, weight, None, rows.shape[0])
        else:
            out = torch.ops.mkldnn._linear_pointwise.default(rows, pack, None, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])

    return run


def cached_packs() -> int:
    """How many packs of live weights the registered kernels hold (0 before ``ops.kernels()``)."""
    if native.library_loaded():
        return int(torch.ops.neuron_lmi.packed_linear_live_packs())
    return sum(not ref.expired() for ref, _, _ in _packs.values())


def linear_op(library: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``x @ weight.T`` (``weight`` 2-D; fp32, or bf16 for oneDNN) through ``library``'s op: what a
    traced graph records."""
    return getattr(torch.ops.neuron_lmi, f"{library}_linear")


def dtypes(library: str) -> tuple[torch.dtype, ...]:
    """The weights ``library`` packs on this host: oneDNN's bf16 only where oneDNN runs bf16
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; on an AVX2-only CPU its reorder refuses bf16 weights)."""
    if library == "onednn" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (torch.float32,)
    return DTYPES[library]


def tracing_packed_linears(
    library: str | None, dtype: torch.dtype = torch.float32
) -> AbstractContextManager[None]:
    """While tracing, dense 2-D ``dtype`` weights multiply through ``library``'s op (None: ``F.linear``)."""
    if library is None:
        return nullcontext()
    if dtype not in dtypes(library):
        takes = ", ".join(map(str, dtypes(library)))
        raise ValueError(f"{op_name(library)} takes {takes} weights, not {dtype}")
    return dense_linear_kernel(linear_op(library), dtype)
