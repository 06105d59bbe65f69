"""The remote half of the store: entries mirrored under ``s3://bucket/prefix/<namespace>/<key>/``.

Invariants:
* a remote entry exists iff its ``manifest.json`` exists; ``upload`` writes every artifact first and the
  manifest last, so a reader never sees a manifest whose files are not all there yet;
* entries are immutable (content-addressed): an entry whose manifest is already present is not re-uploaded;
* ``download`` writes into a caller-owned staging folder and checks sizes and SHA-256 against the manifest;
  the caller renames it into place only after that.

The client is ``boto3.client("s3")`` with ``endpoint_url`` from ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) when set, so S3-compatible servers (MinIO, moto) work.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from compile_cache.errors import RemoteError
from compile_cache.manifest import MANIFEST_NAME, Manifest, ManifestError, verify_dir, write_manifest

log = logging.getLogger("compile_cache")


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` → ``("bucket", "some/prefix")``; ValueError for anything else."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"cache url: expected s3://bucket[/prefix], got {url!r}")
    return parsed.netloc, parsed.path.strip("/")


def make_client() -> Any:
    import boto3  # imported lazily: local-only use of the cache never needs it

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    return boto3.client("s3", endpoint_url=endpoint)


class S3Remote:
    """One ``s3://bucket/prefix`` holding cache entries; see the module docstring for the layout."""

    def __init__(self, url: str, client: Any | None = None) -> None:
        self.url = url
        self.bucket, self.prefix = parse_s3_url(url)
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client()
        return self._client

    def _object(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise RemoteError(f"{what} on {self.url}: {exc}") from exc

    def list_entries(self) -> list[tuple[str, str]]:
        """Every ``(namespace, key)`` whose manifest is present, sorted."""
        base = self._object()
        start = f"{base}/" if base else ""
        paginator = self.client.get_paginator("list_objects_v2")
        out = []
        pages = self._call("list", lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=start)))
        for page in pages:
            for obj in page.get("Contents", []):
                parts = obj["Key"][len(start) :].split("/")
                if len(parts) == 3 and parts[2] == MANIFEST_NAME:
                    out.append((parts[0], parts[1]))
        return sorted(out)

    def find(self, key: str) -> str | None:
        """The namespace holding ``key`` remotely, or None."""
        for namespace, k in self.list_entries():
            if k == key:
                return namespace
        return None

    def has_entry(self, namespace: str, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._object(namespace, key, MANIFEST_NAME))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise RemoteError(f"head {namespace}/{key} on {self.url}: {exc}") from exc
        return True

    def read_manifest(self, namespace: str, key: str) -> Manifest:
        obj = self._object(namespace, key, MANIFEST_NAME)
        body = self._call("get manifest", self.client.get_object, Bucket=self.bucket, Key=obj)["Body"].read()
        try:
            return Manifest.parse(body)
        except ManifestError as exc:
            raise RemoteError(f"remote manifest s3://{self.bucket}/{obj} is damaged: {exc}") from exc

    def upload(self, namespace: str, key: str, entry_dir: Path, manifest: Manifest) -> bool:
        """Upload one verified local entry; False if the remote already had it."""
        if self.has_entry(namespace, key):
            return False
        for name in sorted(manifest.files):
            self._call(
                f"upload {name}",
                self.client.upload_file,
                Filename=str(entry_dir / name),
                Bucket=self.bucket,
                Key=self._object(namespace, key, name),
            )
        self._call(
            "upload manifest",
            self.client.upload_file,
            Filename=str(entry_dir / MANIFEST_NAME),
            Bucket=self.bucket,
            Key=self._object(namespace, key, MANIFEST_NAME),
        )
        log.info("pushed key=%s to %s", key, self.url)
        return True

    def download(self, namespace: str, key: str, staging: Path) -> Manifest:
        """Download one entry into ``staging`` and verify it; RemoteError if anything is wrong."""
        manifest = self.read_manifest(namespace, key)
        if manifest.key != key:
            raise RemoteError(f"remote entry {namespace}/{key} holds a manifest for {manifest.key}")
        for name in sorted(manifest.files):
            dest = staging / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            self._call(
                f"download {name}",
                self.client.download_file,
                Bucket=self.bucket,
                Key=self._object(namespace, key, name),
                Filename=str(dest),
            )
        write_manifest(manifest, staging)
        _, report = verify_dir(key, staging)
        if not report.ok:
            raise RemoteError(f"remote entry {namespace}/{key} is damaged: {'; '.join(report.problems)}")
        log.info("pulled key=%s from %s", key, self.url)
        return manifest
