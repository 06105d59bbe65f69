"""The C++ kernels of the ``neuron_lmi::`` ops, built once per host into one library. This module
builds and loads it and knows no op: ``ops`` registers the kernels, the library's or the op modules'
Python ones.

``packed_linear.cpp`` (the packed GEMMs), ``decode_attention.cpp`` (the compiled decode's
attention), ``token_draw.cpp`` (the sampler's draw) and ``lora_delta.cpp`` (adapted lines' LoRA
updates) compile as one translation unit
(``native_kernels.cpp``) with torch's C++ extension builder (about 10 s, one core) into
``~/.cache/neuron-lmi/kernels/torch-<version>-<digest>``; later processes load the built library.
A CPU engine starts the build on a thread (``ops.build_in_background``) as it begins loading its model.
The digest covers the sources, the flags, the CPU's instruction-set flags (the build targets this
CPU, ``-march=native``, so a cache directory shared with another kind of host builds again instead
of running instructions that CPU lacks) and the environment (torch's install path: the build file
names it, so two virtual environments on one host would otherwise rebuild each other's library).

The build holds ``<directory>.lock`` with ``flock``, which the kernel releases when its holder dies,
however it dies. Holding it, a builder removes torch's own lock file (``<directory>/lock``, a plain
file torch's builder waits on forever) where a killed build left it. A wait longer than
``BUILD_LOCK_TIMEOUT_S`` ends with an error naming the lock file. Where the build fails (no
compiler, no ninja, that wait) ``load_library`` says so once and ``ops.kernels`` registers each op
module's Python kernels instead. ``NEURON_LMI_NATIVE_KERNELS=0`` forces that (the Python kernels' own tests).
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

log = logging.getLogger(__name__)

NATIVE_ENV = "NEURON_LMI_NATIVE_KERNELS"  # "0": the Python kernels (debugging; their own tests)
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("packed_linear.cpp", "decode_attention.cpp", "token_draw.cpp", "lora_delta.cpp")
)
HEADERS = (Path(__file__).with_name("vector_math.h"),)
UNIT = Path(__file__).with_name("native_kernels.cpp")  # includes SOURCES: what the builder compiles
FLAGS = ("-O3", "-march=native", "-fopenmp")  # OpenMP: at::parallel_for runs on ATen's threads
NAME = "neuron_lmi_native"
BUILD_LOCK_TIMEOUT_S = 900.0  # a build takes 10-30 s; far past that, the holder is wedged
TORCH_BATON = "lock"  # torch's builder's own lock file in the build directory

_loaded: bool | None = None  # whether the library loaded; None until load_library's first call ends
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


def load_library() -> bool:
    """Build the library (or take it from the cache) and load it, once per process; whether it
    loaded, which registers its kernels. The ops it implements must be defined first: ``ops.kernels``
    imports their modules before it calls this."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _build()
    return _loaded


def library_loaded() -> bool:
    """Whether the library's kernels are registered (False before ``load_library`` finished)."""
    return bool(_loaded)


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
