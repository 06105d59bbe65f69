"""Pruning the local store: by last use, by total size, and of leftovers (damaged or abandoned folders).

Invariants: an entry is removed only while its key lock is held (never under a running compile or pull),
by renaming it to ``.trash-…`` first, so a reader sees it whole or gone; its lock file is unlinked while
held, which lock.py makes safe.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from compile_cache.lock import try_key_lock

log = logging.getLogger("compile_cache")


@dataclass(frozen=True)
class PruneReport:
    """What ``prune`` removed (entry keys and leftover folders), the bytes freed, and what it skipped."""

    removed: tuple[str, ...]
    leftovers: tuple[str, ...]
    freed_bytes: int
    kept: int
    skipped_locked: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "removed": list(self.removed),
            "leftovers": list(self.leftovers),
            "freed_bytes": self.freed_bytes,
            "kept": self.kept,
            "skipped_locked": list(self.skipped_locked),
        }


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _lock_of(ns: Path, key: str) -> Path:
    return ns / f"{key}.lock"


def _remove_locked(path: Path) -> int:
    size = tree_size(path)
    trash = path.with_name(f".trash-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, trash)  # readers see the entry whole or gone, never half deleted
    shutil.rmtree(trash, ignore_errors=True)
    return size


def _drop_stale_lock(lock: Path) -> None:
    key = lock.name.removesuffix(".lock")
    with try_key_lock(lock) as got:
        busy = any(p.name.startswith(f".tmp-{key}-") for p in lock.parent.iterdir())
        if got and not busy and not (lock.parent / key).exists():
            lock.unlink(missing_ok=True)  # safe while held: see lock.py


def _prune_leftovers(root: Path) -> tuple[list[str], int]:
    """Remove ``.corrupt-*``, ``.trash-*``, unlocked ``.tmp-*`` folders and lock files of absent keys."""
    removed, freed = [], 0
    namespaces = (
        [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")] if root.is_dir() else []
    )
    for ns in namespaces:
        for p in sorted(ns.iterdir()):
            name = p.name
            if p.is_file() and name.endswith(".lock") and not (ns / name.removesuffix(".lock")).exists():
                _drop_stale_lock(p)
            elif not p.is_dir():
                continue
            elif ".corrupt-" in name or name.startswith(".trash-"):
                freed += tree_size(p)
                shutil.rmtree(p, ignore_errors=True)
                removed.append(f"{ns.name}/{name}")
            elif name.startswith(".tmp-"):
                key = name.split("-")[1]
                with try_key_lock(_lock_of(ns, key)) as got:
                    if got:  # nobody is writing this key, so the staging folder is abandoned
                        freed += tree_size(p)
                        shutil.rmtree(p, ignore_errors=True)
                        removed.append(f"{ns.name}/{name}")
                        if not (ns / key).exists():
                            _lock_of(ns, key).unlink(missing_ok=True)  # safe while held: see lock.py
    return removed, freed


def prune_store(
    root: Path, entry_dirs: Iterable[Path], older_than: timedelta | None, max_size: int | None
) -> PruneReport:
    """Remove entries whose last use (folder mtime) is before now - ``older_than``, then the least recently
    used until the entries total at most ``max_size`` bytes; leftovers are always removed."""
    if older_than is None and max_size is None:
        raise ValueError("prune: give older_than and/or max_size")
    if max_size is not None and max_size < 0:
        raise ValueError(f"max_size: must be >= 0, got {max_size}")
    leftovers, freed = _prune_leftovers(root)
    entries = sorted((p.stat().st_mtime, p.name, p) for p in entry_dirs)
    sizes = {p: tree_size(p) for _, _, p in entries}
    total = sum(sizes.values())
    cutoff = time.time() - older_than.total_seconds() if older_than is not None else None
    removed, skipped, kept = [], [], 0
    for mtime, key, path in entries:
        too_old = cutoff is not None and mtime < cutoff
        too_big = max_size is not None and total > max_size
        if not (too_old or too_big):
            kept += 1
            continue
        lock = _lock_of(path.parent, key)
        with try_key_lock(lock) as got:
            if not got:
                skipped.append(key)
                kept += 1
                continue
            freed += _remove_locked(path)
            lock.unlink(missing_ok=True)  # safe while held: see lock.py
        total -= sizes[path]
        removed.append(key)
        log.info("pruned key=%s (%s)", key, "unused too long" if too_old else "over max size")
    return PruneReport(tuple(removed), tuple(leftovers), freed, kept, tuple(skipped))
