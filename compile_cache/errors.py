"""Exceptions of the compile cache. All derive from ``CacheError`` (a ``RuntimeError``)."""

from __future__ import annotations


class CacheError(RuntimeError):
    """Base class: a cache operation could not be done; the message says which key and why."""


class CacheMissError(CacheError):
    """No usable entry for a key and compiling was not allowed (``no_compile=True``)."""


class CorruptEntryError(CacheError):
    """An entry failed verification; the message names the key and the damaged files."""


class EntryNotFoundError(CacheError):
    """No entry (or remote entry) has this key or key prefix."""


class RemoteError(CacheError):
    """The remote store (S3) refused or failed a request."""
