"""A store that may not be writable: read it in place, compile and lock somewhere that is.

SageMaker mounts ``/opt/ml/model`` read-only, and ``neuron-lmi package --compiled`` ships compiled
artifacts there (``option.compiled_graph_path=/opt/ml/model/compiled``). Opening that folder as an
ordinary store would write a ``<key>.lock`` (and, on a miss, a staging folder) into it: ``OSError:
Read-only file system``, the failure LMI hit (djl-serving PR #1879). ``open_store`` keeps the folder
as a read-only *seed* in front of a writable store::

    seed  /opt/ml/model/compiled/<ns>/<key>/     matching entries are read in place
    root  $NEURON_LMI_CACHE_DIR/<ns>/<key>[.lock] misses, damaged seeds and locks go here
          (else ~/.cache/neuron-lmi/compile, else <tmp>/neuron-lmi-compile-<uid>)
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from compile_cache.store import CompileCache, default_cache_root

log = logging.getLogger("compile_cache")


def is_writable_dir(path: str | os.PathLike[str]) -> bool:
    """Whether files can be created in ``path``, or, while it does not exist, in the nearest existing
    folder above it (where ``mkdir -p`` would start). ``os.access`` reports a read-only mount for every
    user, root included, and the mode bits for everyone but root."""
    for candidate in (Path(path), *Path(path).parents):
        if candidate.exists():
            return candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK)
    return False


def _private_temp_root() -> Path:
    """``<tmp>/neuron-lmi-compile-<uid>`` (reused across restarts) when it is ours, else a fresh one."""
    path = Path(tempfile.gettempdir()) / f"neuron-lmi-compile-{os.getuid()}"
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = path.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and is_writable_dir(path):
            return path
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="neuron-lmi-compile-"))


def writable_cache_root() -> Path:
    """Where compiles and locks go: ``default_cache_root()`` (``$NEURON_LMI_CACHE_DIR``, else the user's
    cache folder) when it can be written, else a private folder in the temporary directory."""
    root = default_cache_root()
    if is_writable_dir(root):
        return root
    fallback = _private_temp_root()
    log.warning("compile cache %s is not writable; compiling into %s", root, fallback)
    return fallback


def open_store(
    root: str | os.PathLike[str] | None = None, remote: str | None = None, **kwargs: Any
) -> CompileCache:
    """``CompileCache(root, remote, **kwargs)`` when ``root`` (default ``default_cache_root()``) can be
    written; otherwise a store at ``writable_cache_root()`` that reads ``root``'s entries in place as a
    read-only seed and never writes to it."""
    wanted = Path(root).expanduser() if root is not None else default_cache_root()
    if is_writable_dir(wanted):
        return CompileCache(wanted, remote, **kwargs)
    writable = writable_cache_root()
    seeds = (wanted,) if wanted.is_dir() else ()
    log.info("compile cache %s is read-only: using its entries in place; compiling in %s", wanted, writable)
    return CompileCache(writable, remote, seeds=seeds, **kwargs)
