"""Uploading model artifacts to S3: one ``model.tar.gz`` or a folder as an uncompressed prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``; raises ValueError for anything else."""
    if not uri.startswith("s3://"):
        raise ValueError(f"{uri!r}: expected s3://bucket/key")
    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r}: no bucket name")
    return bucket, key


def upload_archive(s3: Any, archive: Path, destination: str) -> str:
    """Upload ``model.tar.gz``; ``destination`` is a key, or a prefix ending in ``/``. Returns its URI."""
    if not archive.is_file():
        raise FileNotFoundError(f"{archive}: no such file")
    bucket, key = split_s3_uri(destination)
    if not key or key.endswith("/"):
        key += archive.name
    s3.upload_file(str(archive), bucket, key)
    return f"s3://{bucket}/{key}"


def upload_directory(s3: Any, folder: Path, destination: str) -> str:
    """Upload every file under ``folder`` below the prefix; returns the prefix URI (ending in ``/``),
    ready for ``ModelDataSource`` with ``CompressionType: None``.

    The prefix must be empty: SageMaker copies every object under it into ``/opt/ml/model``, so a
    file left from an earlier upload (an old shard, a stale ``serving.properties``) would be served
    beside the new ones. Nothing is uploaded when it is not.
    """
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such directory")
    bucket, prefix = split_s3_uri(destination)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise ValueError(f"{folder}: nothing to upload")
    existing = s3.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1).get("Contents", [])
    if existing:
        raise ValueError(
            f"s3://{bucket}/{prefix} is not empty (it holds {existing[0]['Key']!r}): SageMaker would copy "
            "old objects into /opt/ml/model beside the new ones; upload to a new prefix or empty this one"
        )
    for path in files:
        s3.upload_file(str(path), bucket, prefix + path.relative_to(folder).as_posix())
    return f"s3://{bucket}/{prefix}"
