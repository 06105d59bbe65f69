"""S3 model sources: a resumable, verified mirror of ``s3://bucket/prefix`` in a local cache.

Invariants for ``<cache_dir>/s3/<bucket>/<prefix>``:

* a file appears under its final name only after its size (and, when the ETag is a plain MD5, its
  MD5) matched the object; until then it is ``<name>.part``, which the next attempt resumes with a
  ``Range`` GET guarded by ``If-Match: <etag>`` (so a changed object is never spliced onto old bytes);
* ``<dest>.manifest.json`` records ``{relative path: {key, size, etag}}`` of finished files; a file
  whose entry matches the listing and whose size matches on disk is not downloaded again; files an
  earlier listing had and the current one lacks are removed;
* ``<dest>.lock`` (flock) serialises processes fetching the same destination;
* the whole fetch respects one :class:`Deadline` and raises ModelLoadTimeout naming the model,
  keeping ``.part`` files for the next start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

from neuron_lmi.model_source.base import Deadline, ModelSourceError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
ATTEMPTS = 3
PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class S3Object:
    """One object to fetch: its key, path relative to the destination, size and unquoted ETag."""

    key: str
    rel: str
    size: int
    etag: str

    def entry(self) -> dict[str, Any]:
        return {"key": self.key, "size": self.size, "etag": self.etag}


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``; raises ModelSourceError without a bucket."""
    parts = urlsplit(uri)
    if parts.scheme != "s3" or not parts.netloc:
        raise ModelSourceError(f"model {uri!r}: expected s3://bucket/prefix")
    return parts.netloc, parts.path.lstrip("/")


def s3_client(env: Mapping[str, str], deadline: Deadline | None = None) -> Any:
    """A boto3 S3 client from ``env``: credentials, region, ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``."""
    import boto3
    from botocore.config import Config

    left = deadline.remaining() if deadline else None
    read_timeout = 60.0 if left is None else max(1.0, min(60.0, left))
    session = boto3.session.Session(
        aws_access_key_id=env.get("AWS_ACCESS_KEY_ID") or None,
        aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY") or None,
        aws_session_token=env.get("AWS_SESSION_TOKEN") or None,
        region_name=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
    )
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    config = Config(connect_timeout=10, read_timeout=read_timeout, retries={"max_attempts": 3})
    return session.client("s3", endpoint_url=endpoint, config=config)


def list_s3(client: Any, bucket: str, prefix: str) -> tuple[list[S3Object], bool]:
    """The objects under ``prefix`` and whether ``prefix`` named one object (then the list has one)."""
    from botocore.exceptions import ClientError

    if prefix and not prefix.endswith("/"):
        try:
            head = client.head_object(Bucket=bucket, Key=prefix)
            name = PurePosixPath(prefix).name
            return [S3Object(prefix, name, int(head["ContentLength"]), head["ETag"].strip('"'))], True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                raise
    folder = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
    objects = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=folder):
        for item in page.get("Contents", []):
            rel = item["Key"][len(folder) :]
            if not rel or rel.endswith("/"):
                continue  # "directory" marker objects
            if rel.startswith("/") or ".." in PurePosixPath(rel).parts:
                raise ModelSourceError(f"s3://{bucket}/{item['Key']}: unsafe key")
            objects.append(S3Object(item["Key"], rel, int(item["Size"]), item["ETag"].strip('"')))
    return objects, False


def _md5_comparable(etag: str, encryption: str | None) -> bool:
    """Plain-MD5 ETags: not multipart (``-N``) and not SSE-KMS/SSE-C encrypted."""
    return re.fullmatch(r"[0-9a-f]{32}", etag) is not None and not (encryption or "").startswith("aws:kms")


def verify_file(
    path: Path, size: int, etag: str, encryption: str | None = None, name: str | None = None
) -> str | None:
    """None when ``path`` matches the object; otherwise why not (size or ETag mismatch).

    The ETag is compared as an MD5 only when it is one (see ``_md5_comparable``); otherwise only the
    size is checked. ``name`` is how the file is called in the message (default ``path.name``).
    """
    name = name or path.name
    actual = path.stat().st_size
    if actual != size:
        return f"size mismatch for {name}: expected {size} bytes, have {actual}"
    if _md5_comparable(etag, encryption):
        digest = hashlib.md5(usedforsecurity=False)
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
                digest.update(block)
        if digest.hexdigest() != etag:
            return f"ETag mismatch for {name}: expected {etag}, got {digest.hexdigest()}"
    return None


class _Progress:
    """Logs bytes fetched of the total at most every PROGRESS_EVERY_S seconds."""

    def __init__(self, uri: str, total: int) -> None:
        self.uri, self.total, self.done = uri, total, 0
        self.started = self.last = time.monotonic()

    def add(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            rate = self.done / max(now - self.started, 1e-6) / 2**20
            pct = 100 * self.done / max(self.total, 1)
            mib = (self.done / 2**20, self.total / 2**20)
            logger.info("%s: %.1f / %.1f MiB (%.0f%%), %.1f MiB/s", self.uri, *mib, pct, rate)


def _get_into(
    client: Any, bucket: str, obj: S3Object, part: Path, deadline: Deadline, progress: _Progress
) -> Any:
    """Append the rest of ``obj`` to ``part`` (Range GET when it has bytes); return the SSE mode."""
    offset = part.stat().st_size if part.exists() else 0
    request: dict[str, Any] = {"Bucket": bucket, "Key": obj.key, "IfMatch": f'"{obj.etag}"'}
    if offset:
        request["Range"] = f"bytes={offset}-"
    response = client.get_object(**request)
    if offset and response["ResponseMetadata"]["HTTPStatusCode"] != 206:
        offset = 0  # the server ignored Range and sent the whole object
    progress.add(offset)
    with contextlib.closing(response["Body"]) as body, part.open("ab" if offset else "wb") as handle:
        for chunk in body.iter_chunks(CHUNK_BYTES):
            handle.write(chunk)
            progress.add(len(chunk))
            deadline.check()
    return response.get("ServerSideEncryption")


def _download(
    client: Any, bucket: str, obj: S3Object, target: Path, deadline: Deadline, progress: _Progress
) -> None:
    """Fetch one object to ``target`` through ``target.part``, resuming and verifying (see module doc)."""
    from botocore.exceptions import BotoCoreError, ClientError, FlexibleChecksumError
    from urllib3.exceptions import HTTPError

    part = target.with_name(target.name + ".part")
    target.parent.mkdir(parents=True, exist_ok=True)
    problem = "no attempt made"
    for attempt in range(1, ATTEMPTS + 1):
        deadline.check()
        if part.exists() and part.stat().st_size > obj.size:
            part.unlink()
        resumed = part.exists() and part.stat().st_size > 0
        try:
            if not part.exists() or part.stat().st_size < obj.size or obj.size == 0:
                encryption = _get_into(client, bucket, obj, part, deadline, progress)
            else:  # complete but unverified: the ETag is only an MD5 when the object is not KMS-encrypted
                encryption = client.head_object(Bucket=bucket, Key=obj.key).get("ServerSideEncryption")
        except FlexibleChecksumError as exc:  # botocore checked the object's CRC/SHA and it differs
            problem = f"checksum mismatch for {obj.rel}: {exc}"
            logger.warning("s3://%s/%s: %s; downloading it again", bucket, obj.key, problem)
            part.unlink(missing_ok=True)
            continue
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code not in ("PreconditionFailed", "412", "InvalidRange", "416"):
                raise
            problem = f"object changed while downloading ({code})"
            part.unlink(missing_ok=True)
            continue
        except (BotoCoreError, HTTPError, ConnectionError) as exc:
            problem = f"transfer interrupted: {exc}"
            logger.warning("s3://%s/%s: %s (attempt %d of %d)", bucket, obj.key, problem, attempt, ATTEMPTS)
            continue
        problem = verify_file(part, obj.size, obj.etag, encryption, name=obj.rel) or ""
        if not problem:
            os.replace(part, target)
            return
        how = " (resumed from a partial file)" if resumed else ""
        logger.warning("s3://%s/%s: %s%s; downloading it again", bucket, obj.key, problem, how)
        part.unlink()
    raise ModelSourceError(f"s3://{bucket}/{obj.key}: {problem} after {ATTEMPTS} attempts")


@contextlib.contextmanager
def _locked(path: Path, deadline: Deadline) -> Iterator[None]:
    """Hold an exclusive flock on ``path``, polling so the deadline still applies while waiting."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                deadline.check()
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else {"files": {}}
    except (OSError, ValueError):
        return {"files": {}}


def _write_manifest(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def fetch_s3(uri: str, cache_dir: Path, deadline: Deadline, env: Mapping[str, str]) -> Path:
    """Mirror ``uri`` into ``cache_dir/s3/<bucket>/<prefix>`` and return that directory (or file)."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, prefix = parse_s3_uri(uri)
    dest = Path(cache_dir, "s3", bucket, *PurePosixPath(prefix.rstrip("/")).parts)
    manifest_path = dest.with_name(dest.name + ".manifest.json")
    client = s3_client(env, deadline)
    with _locked(dest.with_name(dest.name + ".lock"), deadline):
        manifest = _read_manifest(manifest_path)
        try:
            objects, single = list_s3(client, bucket, prefix)
        except (BotoCoreError, ClientError) as exc:
            if manifest.get("complete") and manifest.get("source") == uri and _all_present(dest, manifest):
                logger.warning("%s: cannot list (%s); using the complete cached copy in %s", uri, exc, dest)
                return dest / manifest["single"] if manifest.get("single") else dest
            raise ModelSourceError(f"model {uri!r}: cannot list objects: {exc}") from exc
        if not objects:
            raise ModelSourceError(f"model {uri!r}: no objects under this prefix")
        root = dest.parent if single else dest
        old: dict[str, Any] = manifest["files"] if manifest.get("source") == uri else {}
        for rel in set(old) - {o.rel for o in objects}:
            (root / rel).unlink(missing_ok=True)  # left over from an earlier version of the prefix
        todo = [o for o in objects if not (old.get(o.rel) == o.entry() and _size_is(root / o.rel, o.size))]
        files = {o.rel: o.entry() for o in objects if o not in todo}
        single_rel = objects[0].rel if single else None
        manifest = {"source": uri, "files": files, "complete": False, "single": single_rel}
        if todo:
            total = sum(o.size for o in todo)
            counts = (len(todo), len(objects), total / 2**20)
            logger.info("%s: fetching %d of %d files (%.1f MiB) into %s", uri, *counts, root)
            progress = _Progress(uri, total)
            for obj in todo:
                _download(client, bucket, obj, root / obj.rel, deadline, progress)
                files[obj.rel] = obj.entry()
                _write_manifest(manifest_path, manifest)
            took = time.monotonic() - progress.started
            logger.info("%s: fetched %.1f MiB in %.1fs", uri, progress.done / 2**20, took)
        else:
            logger.info("%s: all %d files already in %s", uri, len(objects), root)
        _write_manifest(manifest_path, {**manifest, "complete": True})
    return root / objects[0].rel if single else dest


def _size_is(path: Path, size: int) -> bool:
    return path.is_file() and path.stat().st_size == size


def _all_present(dest: Path, manifest: Mapping[str, Any]) -> bool:
    root = dest.parent if manifest.get("single") else dest
    return all(_size_is(root / rel, int(e["size"])) for rel, e in manifest["files"].items())
