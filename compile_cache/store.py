"""The local content-addressed store of compiled artifacts, optionally mirrored to S3.

Layout under the root (``default_cache_root()``)::

    <root>/<target>-<compiler version>/<key>/              a complete entry: artifacts + manifest.json
    <root>/<target>-<compiler version>/<key>.lock          the key's inter-process lock (see lock.py)
    <root>/<target>-<compiler version>/.tmp-<key>-<rand>/  an entry being written (compile or pull)
    <root>/<target>-<compiler version>/<key>.corrupt-<ts>/ a damaged entry moved aside, kept for inspection

Invariants:
* an entry folder appears only by ``os.rename`` of a fully written staging folder whose manifest was
  written (and fsynced) last, so readers see a whole entry or none;
* entries are immutable; a folder that fails verification (missing, changed or extra files, bad
  manifest) is never returned: it is logged with its key and files and renamed to ``.corrupt-<ts>``;
* compiling, pulling, quarantining and pruning a key happen under that key's lock, so concurrent
  processes compile a key once; the others wait (up to ``lock_timeout``) and reuse the result;
* an entry's folder mtime is its last use (refreshed on each hit); ``prune`` removes least recently used;
* ``seeds`` are read-only stores (SageMaker mounts ``/opt/ml/model`` read-only) searched before the root:
  a verified, matching entry there is read in place; nothing (a lock, a use time, a quarantine
  rename, a compile) is ever written to a seed. ``layers.open_store`` builds such a store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from compile_cache.errors import (
    CacheError,
    CacheMissError,
    CorruptEntryError,
    EntryNotFoundError,
    RemoteError,
)
from compile_cache.key import KEY_LENGTH, CacheKeyInputs
from compile_cache.lock import key_lock
from compile_cache.manifest import Manifest, VerifyReport, build_manifest, verify_dir, write_manifest
from compile_cache.prune import PruneReport, prune_store
from compile_cache.s3 import S3Remote

log = logging.getLogger("compile_cache")
DEFAULT_LOCK_TIMEOUT_S = 4 * 3600.0  # a large model's compile can take an hour or more


def default_cache_root() -> Path:
    """``$NEURON_LMI_CACHE_DIR``, else ``$XDG_CACHE_HOME/neuron-lmi/compile``,
    else ``~/.cache/neuron-lmi/compile``."""
    if os.environ.get("NEURON_LMI_CACHE_DIR"):
        return Path(os.environ["NEURON_LMI_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "neuron-lmi" / "compile"


def _is_key(name: str) -> bool:
    return len(name) == KEY_LENGTH and all(c in "0123456789abcdef" for c in name)


@dataclass(frozen=True)
class Entry:
    """A verified entry: read artifacts from ``path``; never write there (entries are immutable)."""

    key: str
    path: Path
    manifest: Manifest

    @property
    def inputs(self) -> CacheKeyInputs:
        return self.manifest.inputs

    @property
    def namespace(self) -> str:
        return self.path.parent.name

    @property
    def size(self) -> int:
        return self.manifest.size

    @property
    def files(self) -> list[str]:
        return sorted(self.manifest.files)

    def file(self, name: str) -> Path:
        if name not in self.manifest.files:
            raise KeyError(f"entry {self.key} has no file {name!r}")
        return self.path / name

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "path": str(self.path), **self.manifest.to_json()}


class CompileCache:
    """Local store at ``root`` (default ``default_cache_root()``), mirrored to ``remote`` (``s3://…``).

    ``checksums=False`` makes lookups check sizes only (``verify`` always checks SHA-256). ``seeds`` are
    read-only stores looked up first and never written (see the module docstring).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        remote: str | None = None,
        *,
        seeds: Sequence[str | os.PathLike[str]] = (),
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
        checksums: bool = True,
        s3_client: Any | None = None,
    ) -> None:
        self.root = Path(root).expanduser() if root is not None else default_cache_root()
        self.remote = S3Remote(remote, client=s3_client) if remote else None
        self.lock_timeout = float(lock_timeout)
        self.checksums = checksums
        self.seeds = tuple(Path(seed).expanduser() for seed in seeds)

    # ---- paths -------------------------------------------------------------------------------------
    def _entry_dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(
            p for ns in self.root.iterdir() if ns.is_dir() and not ns.name.startswith(".")
            for p in ns.iterdir() if p.is_dir() and _is_key(p.name)
        )  # fmt: skip

    def _lock_path(self, namespace: str, key: str) -> Path:
        return self.root / namespace / f"{key}.lock"

    def resolve(self, key: str) -> Path:
        """The folder of the entry whose key is ``key`` or starts with it (at least 6 characters)."""
        key = key.strip().lower()
        if len(key) < 6 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"key: expected at least 6 hex characters, got {key!r}")
        matches = [p for p in self._entry_dirs() if p.name.startswith(key)]
        if not matches:
            raise EntryNotFoundError(f"no entry with key {key} under {self.root}")
        if len(matches) > 1:
            raise ValueError(f"key prefix {key} is ambiguous: {', '.join(str(p) for p in matches)}")
        return matches[0]

    # ---- reading ------------------------------------------------------------------------------------
    def _quarantine(self, path: Path, report: VerifyReport) -> Path:
        dest = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        log.error("damaged cache entry key=%s at %s: %s", report.key, path, "; ".join(report.problems))
        os.rename(path, dest)
        log.error("moved damaged entry key=%s aside to %s", report.key, dest)
        return dest

    def _verify(self, inputs: CacheKeyInputs, path: Path) -> tuple[Manifest | None, VerifyReport]:
        """``verify_dir``, plus: the manifest must be for exactly these inputs."""
        key = inputs.key()
        manifest, report = verify_dir(key, path, self.checksums)
        if manifest is not None and manifest.inputs != inputs:
            report = VerifyReport(key, path, manifest_error="manifest inputs differ from the requested ones")
        return manifest, report

    def _lookup(self, inputs: CacheKeyInputs, locked: bool) -> tuple[Entry | None, VerifyReport | None]:
        key, path = inputs.key(), self.root / inputs.namespace / inputs.key()
        if not path.is_dir():
            return None, None
        manifest, report = self._verify(inputs, path)
        if report.ok and manifest is not None:
            with contextlib.suppress(OSError):  # a read-only cache simply keeps the creation time
                os.utime(path)  # last use, for prune
            log.info("compile cache hit key=%s path=%s", key, path)
            return Entry(key, path, manifest), None
        if not locked:
            with key_lock(self._lock_path(inputs.namespace, key), self.lock_timeout):
                return self._lookup(inputs, locked=True)  # damage counts only if seen under the lock
        self._quarantine(path, report)
        return None, report

    def _seed_lookup(self, inputs: CacheKeyInputs) -> tuple[Entry | None, VerifyReport | None]:
        """A verified entry for ``inputs`` in a read-only seed, used in place; damage is only logged."""
        key, damage = inputs.key(), None
        for seed in self.seeds:
            path = seed / inputs.namespace / key
            if not path.is_dir():
                continue
            manifest, report = self._verify(inputs, path)
            if report.ok and manifest is not None:
                log.info("compile cache hit key=%s path=%s (read-only seed)", key, path)
                return Entry(key, path, manifest), None
            problems = "; ".join(report.problems)
            log.error("damaged read-only cache entry key=%s at %s: %s; left in place", key, path, problems)
            damage = damage or report
        return None, damage

    def lookup(self, inputs: CacheKeyInputs) -> Entry | None:
        """The verified entry for ``inputs`` (seeds first), or None (a damaged local one is moved aside)."""
        entry, _ = self._seed_lookup(inputs)
        if entry is None:
            entry, _ = self._lookup(inputs, locked=False)
        if entry is None:
            log.info("compile cache miss key=%s", inputs.key())
        return entry

    def verify(self, key: str) -> VerifyReport:
        """Check one entry (key or unique prefix) against its manifest, with SHA-256; moves nothing."""
        path = self.resolve(key)
        return verify_dir(path.name, path, checksums=True)[1]

    def verify_all(self) -> list[VerifyReport]:
        return [verify_dir(p.name, p, checksums=True)[1] for p in self._entry_dirs()]

    def list(self) -> list[Entry]:
        """Entries with a readable manifest (files are not checksummed: use ``verify``), oldest first."""
        out = []
        for path in self._entry_dirs():
            manifest, report = verify_dir(path.name, path, checksums=False)
            if manifest is None:
                log.warning("cache entry key=%s has a damaged manifest: %s", path.name, report.manifest_error)
                continue
            out.append(Entry(path.name, path, manifest))
        return sorted(out, key=lambda e: (e.manifest.created_unix, e.key))

    def show(self, key: str) -> Entry:
        """The entry for a key or unique prefix; CorruptEntryError if its manifest is unreadable."""
        path = self.resolve(key)
        manifest, report = verify_dir(path.name, path, checksums=False)
        if manifest is None:
            raise CorruptEntryError(f"entry {path.name} at {path}: {report.manifest_error}")
        return Entry(path.name, path, manifest)

    # ---- writing ------------------------------------------------------------------------------------
    def _staging(self, namespace: str, key: str) -> Path:
        (self.root / namespace).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=self.root / namespace))

    def _install(self, staging: Path, final: Path, manifest: Manifest) -> Entry:
        os.chmod(staging, 0o755)  # mkdtemp makes 0700; a shared cache must be readable by others
        os.rename(staging, final)  # atomic; the caller holds the key lock, so ``final`` does not exist
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return Entry(final.name, final, manifest)

    def _compile(self, inputs: CacheKeyInputs, compile_fn: Callable[[Path], None]) -> Entry:
        key = inputs.key()
        staging = self._staging(inputs.namespace, key)
        try:
            started = time.monotonic()
            compile_fn(staging)
            manifest = build_manifest(inputs, staging)
            if not manifest.files:
                raise CacheError(f"compile for key {key} wrote no files into {staging}")
            write_manifest(manifest, staging)
            entry = self._install(staging, self.root / inputs.namespace / key, manifest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        log.info("compiled key=%s in %.1fs into %s", key, time.monotonic() - started, entry.path)
        return entry

    def _pull_locked(self, namespace: str, key: str) -> Entry | None:
        if self.remote is None or not self.remote.has_entry(namespace, key):
            return None
        staging = self._staging(namespace, key)
        try:
            manifest = self.remote.download(namespace, key, staging)
            return self._install(staging, self.root / namespace / key, manifest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def get_or_compile(
        self, inputs: CacheKeyInputs, compile_fn: Callable[[Path], None], no_compile: bool = False
    ) -> Entry:
        """The verified entry for ``inputs``: a seed's or a local hit, else pulled from the remote, else
        compiled into the root.

        ``compile_fn(dir)`` writes the artifacts into an empty staging folder; it runs at most once per
        key across processes sharing ``root``. With ``no_compile=True`` a miss raises ``CacheMissError``
        (``CorruptEntryError`` if the local entry was damaged). A new entry is pushed to the remote.
        """
        key, namespace = inputs.key(), inputs.namespace
        entry, seed_damage = self._seed_lookup(inputs)
        if entry is not None:
            return entry
        entry, damage = self._lookup(inputs, locked=False)
        if entry is not None:
            return entry
        with key_lock(self._lock_path(namespace, key), self.lock_timeout):
            entry, again = self._lookup(inputs, locked=True)  # another process may have just finished
            damage = again or damage or seed_damage
            if entry is None and self.remote is not None:
                try:
                    entry = self._pull_locked(namespace, key)
                except RemoteError as exc:
                    log.warning("could not pull key=%s: %s", key, exc)
            if entry is not None:
                return entry
            if no_compile:
                if damage is not None:
                    fate = "left in place" if damage is seed_damage else "moved aside"
                    raise CorruptEntryError(
                        f"cache entry {key} at {damage.path} was damaged ({'; '.join(damage.problems)}) "
                        f"and {fate}; not recompiling because no_compile=True"
                    )
                where = f"{self.root}" + (f" or {self.remote.url}" if self.remote else "")
                raise CacheMissError(f"no compiled artifacts for key {key} in {where} and no_compile=True")
            log.info("compile cache miss key=%s; compiling", key)
            entry = self._compile(inputs, compile_fn)
        if self.remote is not None:
            try:
                self.remote.upload(namespace, key, entry.path, entry.manifest)
            except RemoteError as exc:  # the local entry is good; a failed push must not lose it
                log.warning("could not push key=%s: %s", key, exc)
        return entry

    # ---- remote -------------------------------------------------------------------------------------
    def _require_remote(self) -> S3Remote:
        if self.remote is None:
            raise ValueError("no remote configured: pass --cache-url s3://bucket/prefix")
        return self.remote

    def push(self, key: str | None = None) -> dict[str, str]:
        """Upload one entry (or all) to the remote: key → ``pushed`` | ``already-remote`` | ``damaged``."""
        remote = self._require_remote()
        paths = [self.resolve(key)] if key is not None else self._entry_dirs()
        out = {}
        for path in paths:
            manifest, report = verify_dir(path.name, path, checksums=True)
            if manifest is None or not report.ok:
                if key is not None:
                    problems = "; ".join(report.problems)
                    raise CorruptEntryError(f"not pushing damaged entry {path.name}: {problems}")
                log.error("not pushing damaged entry key=%s: %s", path.name, "; ".join(report.problems))
                out[path.name] = "damaged"
                continue
            pushed = remote.upload(path.parent.name, path.name, path, manifest)
            out[path.name] = "pushed" if pushed else "already-remote"
        return out

    def pull(self, key: str | None = None) -> dict[str, str]:
        """Download one remote entry (key or prefix), or all: key → ``pulled`` | ``already-local``."""
        remote = self._require_remote()
        wanted = remote.list_entries()
        if key is not None:
            wanted = [(ns, k) for ns, k in wanted if k.startswith(key.strip().lower())]
            if not wanted:
                raise EntryNotFoundError(f"no entry with key {key} on {remote.url}")
            if len(wanted) > 1:
                raise ValueError(f"key prefix {key} is ambiguous on {remote.url}: {[k for _, k in wanted]}")
        out = {}
        for namespace, k in wanted:
            with key_lock(self._lock_path(namespace, k), self.lock_timeout):
                path = self.root / namespace / k
                if path.is_dir():
                    _, report = verify_dir(k, path, self.checksums)
                    if report.ok:
                        out[k] = "already-local"
                        continue
                    self._quarantine(path, report)
                self._pull_locked(namespace, k)
                out[k] = "pulled"
        return out

    # ---- pruning ------------------------------------------------------------------------------------
    def prune(self, older_than: timedelta | None = None, max_size: int | None = None) -> PruneReport:
        """Remove entries unused for ``older_than``, then least recently used ones until the store is
        at most ``max_size`` bytes; also damaged (``.corrupt-*``) and abandoned staging folders and stale
        lock files. Entries whose lock is held (being compiled or pulled) are skipped. See prune.py."""
        return prune_store(self.root, self._entry_dirs(), older_than, max_size)
