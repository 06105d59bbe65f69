"""fp32 GEMMs on MKL-packed weights inside the compiled decode: ``torch.ops.neuron_lmi.mkl_linear``.

A decode step multiplies a few rows by every weight, and the weights stream from memory. MKL's
packed GEMM (``cblas_sgemm_pack`` / ``_compute``, which torch exposes as ``mkl::_mkl_linear``) runs
those shapes faster than ``F.linear`` and the ATen ``mm`` an fp32 AOTInductor package calls on its
frozen weights (MKL's plain SGEMM, which re-blocks the weight on every call), and faster than
oneDNN's packed linear. Measured on this project's 2-core AVX-512 host (torch 2.13), all of SmolLM2's
decode GEMMs (30 layers and the 49152 x 576 head), one step, best of several:

    rows   F.linear   oneDNN packed   MKL packed
    1      21 ms      42 ms           29-33 ms
    8      74 ms      57 ms           49 ms
    16     78 ms      68 ms           44 ms
    32     88-103 ms  80-95 ms        58-66 ms

Inductor uses MKL's packed GEMM itself in JIT mode only: in an AOT package a packed buffer cannot be
a constant (MKL keeps address-dependent metadata in it, so it must be made in the process that uses
it), and its lowering wants a static row count. This op takes the plain weight, which the package
freezes as usual, and packs it on first use in this process: one pack per weight storage, reused by
every row count (the packed layout does not depend on the rows; ``mkl::_mkl_linear`` is told the
actual count, so it never falls back to ``F.linear``). At 16 rows and more the results match
``F.linear`` bit for bit on SmolLM2's shapes; below that MKL takes another path and they differ in
the last bits (greedy ids stayed the eager engine's: ``tests/compile/test_cpu_graphs.py``).

Inside a package, AOTInductor's proxy executor calls the op through the dispatcher. Its kernel is
native (``mkl_linear.cpp``, built on first use with torch's C++ extension builder, about 15 s, into
``~/.cache/neuron-lmi/kernels``): a Python kernel costs about 30 us a call there, 3.5 ms over
SmolLM2's 121 GEMMs a step, which made a one-row step slower than ATen's. Where the build fails (no
C++ compiler) the Python kernel below runs instead, with a warning. Importing this module defines
the op; ``kernel()`` registers its CPU kernel, which tracing (``tracing_mkl_linears``) and opening a
package (``cpu_decode.open_frozen_entry``) do first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from neuron_lmi.models.quant import dense_linear_kernel

log = logging.getLogger(__name__)

OP_NAME = "neuron_lmi::mkl_linear"
SOURCE = Path(__file__).with_suffix(".cpp")
PACK_ROWS = 32  # what a pack is made for; any row count runs on it (as in mkl_linear.cpp)
NATIVE_ENV = "NEURON_LMI_NATIVE_KERNELS"  # "0": the Python kernel (debugging; its own test)

_library = torch.library.Library("neuron_lmi", "DEF")
_library.define("mkl_linear(Tensor x, Tensor weight) -> Tensor")


@torch.library.register_fake(OP_NAME, lib=_library)
def _mkl_linear_shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_kernel: str | None = None  # "native" or "python", once registered
_lock = threading.Lock()


def available() -> bool:
    """Whether this torch build has MKL's packed GEMM (x86 builds with MKL)."""
    return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_linear")


def kernel() -> str:
    """Register the op's CPU kernel once (``native``, else ``python``) and say which runs."""
    global _kernel
    with _lock:
        if _kernel is None:
            _kernel = "native" if _load_native() else "python"
            if _kernel == "python":
                _library.impl("mkl_linear", _python_kernel, "CPU")
    return _kernel


def build_directory() -> Path:
    """Per torch version and source: a new torch or a changed kernel builds again."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "neuron-lmi" / "kernels" / f"torch-{torch.__version__}-{digest}"


@contextmanager
def _interpreter_bin_on_path() -> Iterator[None]:
    # The builder runs ``ninja`` from PATH; pip's ninja lands beside this interpreter.
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), previous])
    try:
        yield
    finally:
        os.environ["PATH"] = previous


def _load_native() -> bool:
    if os.environ.get(NATIVE_ENV) == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        with _interpreter_bin_on_path():
            load(
                name="neuron_lmi_mkl_linear",
                sources=[str(SOURCE)],
                extra_cflags=["-O2"],
                build_directory=str(directory),
                is_python_module=False,
            )
    except Exception as exc:  # no compiler or ninja, a failed build: the Python kernel still works
        log.warning("%s: native kernel unavailable (%s); its Python kernel runs instead", OP_NAME, exc)
        return False
    return True


# The Python kernel. weight.data_ptr() -> (a weak reference to its storage, its layout, the pack): a
# storage that died may have its address reused by another weight, and a transposed view shares the
# address of what it views, so only a live storage with the same shape and strides reuses a pack.
_packs: dict[int, tuple[StorageWeakRef, tuple[tuple[int, ...], ...], torch.Tensor]] = {}
_packs_lock = threading.Lock()


def _packed(weight: torch.Tensor) -> torch.Tensor:
    key, layout = weight.data_ptr(), (tuple(weight.shape), weight.stride())
    hit = _packs.get(key)
    if hit is not None and not hit[0].expired() and hit[1] == layout:
        return hit[2]
    for stale in [k for k, (ref, _, _) in _packs.items() if ref.expired()]:
        del _packs[stale]
    pack = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), PACK_ROWS)
    _packs[key] = (StorageWeakRef(weight.untyped_storage()), layout, pack)
    return pack


def _python_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    with _packs_lock:
        pack = _packed(weight)
    out = torch.ops.mkl._mkl_linear.default(rows, pack, weight, None, rows.shape[0])
    return out.view(*x.shape[:-1], weight.shape[0])


def cached_packs() -> int:
    """How many packs of live weights the registered kernel holds (0 before ``kernel()``)."""
    if _kernel == "native":
        return int(torch.ops.neuron_lmi.mkl_linear_live_packs())
    return sum(not ref.expired() for ref, _, _ in _packs.values())


def mkl_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``weight`` 2-D fp32) through the op: what a traced graph records."""
    return torch.ops.neuron_lmi.mkl_linear(x, weight)


def uses_mkl_linear(dtype: torch.dtype) -> bool:
    """Whether a compiled decode of a ``dtype`` model runs its dense GEMMs through the op: fp32 only
    (bf16 runs Inductor's AMX templates), and only where MKL is there."""
    return dtype == torch.float32 and available()


def tracing_mkl_linears(dtype: torch.dtype) -> AbstractContextManager[None]:
    """While tracing a ``dtype`` graph, dense fp32 weights multiply through the op (``uses_mkl_linear``)."""
    if not uses_mkl_linear(dtype):
        return nullcontext()
    kernel()
    return dense_linear_kernel(mkl_linear)
