"""The C++ kernels of the ``neuron_lmi::`` ops, built once per host into one library.

``packed_linear.cpp`` (the packed GEMMs), ``decode_attention.cpp`` (the compiled decode's
attention) and ``token_draw.cpp`` (the sampler's draw) compile as one translation unit
(``native_kernels.cpp``) with torch's C++ extension builder (about 10 s, one core) into
``~/.cache/neuron-lmi/kernels/torch-<version>-<digest>``; later processes load the built library.
A CPU engine starts the build on a thread (``build_in_background``) as it begins loading its model.
The digest covers the sources, the flags, the CPU's instruction-set flags (the build targets this
CPU, ``-march=native``, so a cache directory shared with another kind of host builds again instead
of running instructions that CPU lacks) and the environment (torch's install path: the build file
names it, so two virtual environments on one host would otherwise rebuild each other's library).

The build holds ``<directory>.lock`` with ``flock``, which the kernel releases when its holder dies,
however it dies. Holding it, a builder removes torch's own lock file (``<directory>/lock``, a plain
file torch's builder waits on forever) where a killed build left it. A wait longer than
``BUILD_LOCK_TIMEOUT_S`` ends with an error naming the lock file. Where the build fails (no
compiler, no ninja, that wait) ``kernels`` says so once and registers each op module's Python
kernels instead. ``NEURON_LMI_NATIVE_KERNELS=0`` forces that (the Python kernels' own tests).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from compile_cache.lock import LockTimeoutError, key_lock
from neuron_lmi.models import host_isa

log = logging.getLogger(__name__)

NATIVE_ENV = "NEURON_LMI_NATIVE_KERNELS"  # "0": the Python kernels (debugging; their own tests)
SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("packed_linear.cpp", "decode_attention.cpp", "token_draw.cpp")
)
HEADERS = (Path(__file__).with_name("vector_math.h"),)
UNIT = Path(__file__).with_name("native_kernels.cpp")  # includes SOURCES: what the builder compiles
FLAGS = ("-O3", "-march=native", "-fopenmp")  # OpenMP: at::parallel_for runs on ATen's threads
NAME = "neuron_lmi_native"
BUILD_LOCK_TIMEOUT_S = 900.0  # a build takes 10-30 s; far past that, the holder is wedged
TORCH_BATON = "lock"  # torch's builder's own lock file in the build directory

_kernels: str | None = None  # "native" or "python", once registered
_builder: threading.Thread | None = None  # build_in_background's thread, started once a process
_lock = threading.Lock()


def cpuinfo_field(name: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first ``name`` line of ``cpuinfo`` (``vendor_id``, ``flags``), or "" where it cannot be read."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return ""


def host_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first ``flags`` line of ``cpuinfo`` as a set (empty where there is none: not Linux, or
    not x86)."""
    return frozenset(cpuinfo_field("flags", cpuinfo).split())


def build_directory() -> Path:
    """Per torch version and install, sources, flags and CPU: any change builds again."""
    digest = hashlib.sha256()
    for source in (UNIT, *SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(cpuinfo_field("flags").encode())  # "" where unreadable: sources and flags only
    digest.update(str(Path(torch.__file__).resolve().parent).encode())  # the build file names it
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "neuron-lmi" / "kernels" / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"


@contextmanager
def _interpreter_bin_on_path() -> Iterator[None]:
    # The builder runs ``ninja`` from PATH; pip's ninja lands beside this interpreter.
    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), previous])
    try:
        yield
    finally:
        os.environ["PATH"] = previous


def kernels() -> str:
    """Register the CPU kernels of every ``neuron_lmi::`` op once per process and say which run:
    ``native`` (the library, built or taken from the cache), else ``python`` (each op module's
    ``register_python_kernels``, with a warning from the failed build)."""
    global _kernels
    if _kernels is not None:  # called per step by the sampler: registered once, nothing to ask
        return _kernels
    host_isa.request_amx()  # before any native kernel or package runs (host_isa says why)
    with _lock:
        if _kernels is None:
            # The library implements these modules' ops: they must be defined before it loads.
            from neuron_lmi.models import decode_attention, packed_linear, token_draw

            if _build():
                _kernels = "native"
            else:
                decode_attention.register_python_kernels()
                packed_linear.register_python_kernels()
                token_draw.register_python_kernels()
                _kernels = "python"
    return _kernels


def build_in_background() -> None:
    """Start ``kernels`` on a thread. A first start on a host builds the library (about 10 s, one
    core) while the model loads and the graphs trace and compile, which keep one core busy most of
    that time; tracing needs the ops' schemas and fake kernels only (defined on import), and whatever
    must run an op calls ``kernels``, which waits for the build under its lock."""
    # Imported here, by the caller: the thread imports nothing while it holds the lock.
    from neuron_lmi.models import decode_attention, packed_linear, token_draw  # noqa: F401

    global _builder
    host_isa.request_amx()
    if _kernels is None and _builder is None:
        # Not a daemon: an interpreter exiting mid-build waits for it, since torch's builder would
        # otherwise leave its lock file in the build directory and the next build wait on it forever.
        _builder = threading.Thread(target=kernels, name="neuron-lmi-native-build")
        _builder.start()


def registered() -> str | None:
    """What ``kernels`` registered (``native``, ``python``), or None before its first call."""
    return _kernels


def build_lock_path(directory: Path) -> Path:
    """The ``flock`` a build of ``directory`` holds: beside it, so removing the directory keeps it."""
    return directory.with_name(f"{directory.name}.lock")


def _remove_stale_baton(directory: Path) -> None:
    # Called holding the build's flock: no live builder of this directory exists, so torch's lock
    # file, if any, was left by a build killed mid-way, and torch's builder would wait on it forever.
    baton = directory / TORCH_BATON
    if baton.exists():
        log.warning("removing %s, left by a kernel build that was killed mid-way", baton)
        baton.unlink(missing_ok=True)


def _build() -> bool:
    if os.environ.get(NATIVE_ENV) == "0":
        return False
    try:
        from torch.utils.cpp_extension import load as load_extension

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        with key_lock(build_lock_path(directory), BUILD_LOCK_TIMEOUT_S), _interpreter_bin_on_path():
            _remove_stale_baton(directory)
            load_extension(
                name=NAME,
                sources=[str(UNIT)],
                extra_cflags=list(FLAGS),
                extra_ldflags=["-fopenmp"],  # the soname torch already loaded: one OpenMP runtime
                build_directory=str(directory),
                is_python_module=False,
            )
    except LockTimeoutError as exc:
        log.error("neuron_lmi native kernels not built: %s; the Python kernels run instead", exc)
        return False
    except Exception as exc:  # no compiler or ninja, a failed build: the Python kernels still work
        log.warning("neuron_lmi native kernels unavailable (%s); the Python kernels run instead", exc)
        return False
    return True
