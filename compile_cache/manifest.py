"""``manifest.json``: what an entry holds, and checking that the folder still holds exactly that.

Format (``MANIFEST_VERSION`` 1)::

    {"manifest_version": 1, "key": "<24 hex>", "inputs": {<CacheKeyInputs.describe()>},
     "files": {"<relative posix path>": {"size": <bytes>, "sha256": "<hex>"}, ...},
     "created": "<ISO-8601 UTC>", "created_unix": <float>, "tool": {"name": "neuron-lmi", "version": "..."}}

Invariants: ``key == CacheKeyInputs.from_description(inputs).key()``; file paths are relative, use ``/``,
and never contain ``..`` (a manifest pulled from a remote cannot write outside its entry); the manifest
itself is not listed in ``files``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from compile_cache.key import CacheKeyInputs

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
TOOL_NAME = "neuron-lmi"


def tool_version() -> str:
    try:
        from neuron_lmi import __version__  # the product above this library, where installed
    except ImportError:  # compile_cache used without the neuron_lmi package
        return "unknown"
    return __version__


@dataclass(frozen=True)
class FileRecord:
    """One artifact file: its size in bytes and SHA-256."""

    size: int
    sha256: str


class ManifestError(ValueError):
    """A manifest that is missing, truncated, not JSON, or inconsistent with itself."""


def sha256_file(path: Path, fsync: bool = False) -> str:
    """SHA-256 of a file; with ``fsync`` also flush it to disk (used before an entry is renamed in)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(8 * 1024 * 1024):
            h.update(chunk)
        if fsync:
            os.fsync(fh.fileno())
    return h.hexdigest()


def _check_relpath(name: str) -> str:
    p = PurePosixPath(name)
    if (
        not name
        or p.is_absolute()
        or "\\" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise ManifestError(f"file name {name!r} is not a plain relative path")
    if name == MANIFEST_NAME:
        raise ManifestError(f"file name {name!r} is reserved")
    return name


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json`` of one entry. Immutable; ``files`` maps relative path to record."""

    key: str
    inputs: CacheKeyInputs
    files: Mapping[str, FileRecord]
    created_unix: float
    tool: Mapping[str, str] = field(default_factory=dict)

    @property
    def created(self) -> datetime:
        return datetime.fromtimestamp(self.created_unix, tz=UTC)

    @property
    def size(self) -> int:
        return sum(r.size for r in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest_version": MANIFEST_VERSION,
            "key": self.key,
            "inputs": self.inputs.describe(),
            "files": {n: {"size": r.size, "sha256": r.sha256} for n, r in sorted(self.files.items())},
            "created": self.created.isoformat(),
            "created_unix": self.created_unix,
            "tool": dict(self.tool),
        }

    @classmethod
    def parse(cls, data: bytes) -> Manifest:
        """Parse and self-check manifest bytes; any defect raises ``ManifestError`` naming it."""
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"not valid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ManifestError("not a JSON object")
        if raw.get("manifest_version") != MANIFEST_VERSION:
            raise ManifestError(f"unsupported manifest_version {raw.get('manifest_version')!r}")
        try:
            inputs = CacheKeyInputs.from_description(raw["inputs"])
            files = {}
            for name, rec in raw["files"].items():
                size, digest = rec["size"], rec["sha256"]
                if not isinstance(size, int) or size < 0 or not isinstance(digest, str) or len(digest) != 64:
                    raise ManifestError(f"bad record for {name!r}: {rec!r}")
                files[_check_relpath(name)] = FileRecord(size, digest)
            key, created = str(raw["key"]), float(raw["created_unix"])
            tool = {str(k): str(v) for k, v in dict(raw.get("tool", {})).items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ManifestError(f"missing or malformed field ({exc!r})") from exc
        except ValueError as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(str(exc)) from exc
        if inputs.key() != key:
            raise ManifestError(f"key {key} does not match its inputs (which hash to {inputs.key()})")
        return cls(key=key, inputs=inputs, files=files, created_unix=created, tool=tool)

    @classmethod
    def read(cls, entry_dir: Path) -> Manifest:
        try:
            data = (entry_dir / MANIFEST_NAME).read_bytes()
        except FileNotFoundError as exc:
            raise ManifestError(f"{MANIFEST_NAME} is missing") from exc
        return cls.parse(data)


def build_manifest(inputs: CacheKeyInputs, staging: Path) -> Manifest:
    """Hash every file under ``staging`` (except a manifest) into a new manifest."""
    files = {}
    for p in sorted(staging.rglob("*")):
        if p.is_symlink() or not p.is_file():
            if p.is_symlink():
                raise ValueError(f"artifact {p.relative_to(staging)} is a symlink; write real files")
            continue
        rel = p.relative_to(staging).as_posix()
        if rel == MANIFEST_NAME:
            continue
        files[_check_relpath(rel)] = FileRecord(p.stat().st_size, sha256_file(p, fsync=True))
    return Manifest(
        key=inputs.key(),
        inputs=inputs,
        files=files,
        created_unix=time.time(),
        tool={"name": TOOL_NAME, "version": tool_version()},
    )


def write_manifest(manifest: Manifest, entry_dir: Path) -> None:
    """Write ``manifest.json`` durably (fsync) so a renamed entry never holds a half-written one."""
    path = entry_dir / MANIFEST_NAME
    with path.open("w", encoding="utf-8") as fh:
        json.dump(manifest.to_json(), fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


@dataclass(frozen=True)
class VerifyReport:
    """Result of checking one entry folder against its manifest. ``ok`` iff nothing is listed."""

    key: str
    path: Path
    manifest_error: str | None = None
    missing: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()  # wrong size or wrong sha256
    unexpected: tuple[str, ...] = ()  # present but not in the manifest

    @property
    def ok(self) -> bool:
        return not (self.manifest_error or self.missing or self.mismatched or self.unexpected)

    @property
    def problems(self) -> list[str]:
        out = [f"manifest: {self.manifest_error}"] if self.manifest_error else []
        out += [f"missing: {n}" for n in self.missing]
        out += [f"wrong size or checksum: {n}" for n in self.mismatched]
        out += [f"not in manifest: {n}" for n in self.unexpected]
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "path": str(self.path),
            "ok": self.ok,
            "manifest_error": self.manifest_error,
            "missing": list(self.missing),
            "mismatched": list(self.mismatched),
            "unexpected": list(self.unexpected),
        }


def verify_dir(key: str, entry_dir: Path, checksums: bool = True) -> tuple[Manifest | None, VerifyReport]:
    """Check ``entry_dir`` against its manifest: sizes always, SHA-256 when ``checksums``."""
    try:
        manifest = Manifest.read(entry_dir)
        if manifest.key != key:
            raise ManifestError(f"manifest is for key {manifest.key}, folder is {key}")
    except ManifestError as exc:
        return None, VerifyReport(key, entry_dir, manifest_error=str(exc))
    missing, mismatched = [], []
    for name, rec in sorted(manifest.files.items()):
        p = entry_dir / name
        try:
            if not p.is_file():
                missing.append(name)
            elif p.stat().st_size != rec.size or (checksums and sha256_file(p) != rec.sha256):
                mismatched.append(name)
        except FileNotFoundError:  # removed while we looked (a concurrent prune)
            missing.append(name)
    present = {
        p.relative_to(entry_dir).as_posix() for p in entry_dir.rglob("*") if p.is_file() or p.is_symlink()
    }
    unexpected = sorted(present - set(manifest.files) - {MANIFEST_NAME})
    report = VerifyReport(key, entry_dir, None, tuple(missing), tuple(mismatched), tuple(unexpected))
    return manifest, report
