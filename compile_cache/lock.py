"""A per-key inter-process lock: ``fcntl.flock`` on ``<namespace>/<key>.lock``.

Invariants:
* the kernel drops a ``flock`` when its holder dies, so a crashed compile never wedges the key;
* after locking, the holder checks that the path still names the inode it locked and retries if not;
  that makes ``unlink`` of a lock file *while holding it* (what ``prune`` does) safe for everyone else;
* locks are not re-entrant: a process that holds a key's lock must not ask for it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from compile_cache.errors import CacheError

log = logging.getLogger("compile_cache")


class LockTimeoutError(CacheError, TimeoutError):
    """Another process held the key's lock for longer than the timeout (a CacheError and a TimeoutError)."""


def _try_lock(path: Path) -> int | None:
    """Lock ``path`` without blocking; return the fd, or None if another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the file we locked was unlinked meanwhile: lock the new one


@contextlib.contextmanager
def key_lock(path: Path, timeout: float, poll: float = 0.1) -> Iterator[None]:
    """Hold the exclusive lock at ``path``; wait at most ``timeout`` seconds, then raise LockTimeoutError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    fd = _try_lock(path)
    if fd is None:
        log.info("waiting for lock %s (another process is compiling this key)", path)
    while fd is None:
        if time.monotonic() >= deadline:
            raise LockTimeoutError(f"lock {path} still held by another process after {timeout:.0f}s")
        time.sleep(poll)
        fd = _try_lock(path)
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def try_key_lock(path: Path) -> Iterator[bool]:
    """Yield True while holding the lock, or False at once if someone else holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _try_lock(path)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)
