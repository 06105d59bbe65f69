"""Hugging Face Hub model sources, failing fast when the Hub cannot be reached.

The local Hub cache is tried first; then ``HF_HUB_OFFLINE`` and a three-second TCP probe (to the
endpoint, or to ``HTTPS_PROXY``) decide before ``snapshot_download`` could spend minutes retrying.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from neuron_lmi.model_source.base import Deadline, ModelLoadTimeout, ModelSourceError

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0
T = TypeVar("T")


def _hub_hint(repo_id: str, reason: str) -> ModelSourceError:
    return ModelSourceError(
        f"model {repo_id!r}: cannot fetch from the Hugging Face Hub ({reason}); copy it locally and pass "
        "a local path, or upload it and pass an s3://bucket/prefix URI"
    )


def _probe(url: str, timeout_s: float) -> str | None:
    """None when a TCP connection to ``url``'s host opens within ``timeout_s``; else the reason."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(exc)

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout_s + 0.5)
    if not outcome:
        return f"no answer from {host}:{port} within {timeout_s:g}s"
    return None if outcome[0] is None else f"cannot reach {host}:{port}: {outcome[0]}"


def _within(deadline: Deadline, call: Callable[[], T]) -> T:
    """Run ``call`` in a daemon thread (so a stuck download cannot block exit) until the deadline."""
    box: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            box.append((True, call()))
        except Exception as exc:  # re-raised in the caller's thread
            box.append((False, exc))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(None if deadline.at is None else max(deadline.remaining() or 0.0, 0.0))
    if not box:
        raise ModelLoadTimeout(f"model {deadline.model_id!r}: not fetched within {deadline.limit_s:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def fetch_hub(
    repo_id: str, cache_dir: Path, deadline: Deadline, env: Mapping[str, str], revision: str | None = None
) -> Path:
    """``snapshot_download`` with the local cache first and a fast failure when the Hub is unreachable."""
    from huggingface_hub import snapshot_download

    hub_cache = env.get("HF_HUB_CACHE") or (Path(env["HF_HOME"]) / "hub" if env.get("HF_HOME") else None)
    cache = Path(hub_cache) if hub_cache else cache_dir / "hf"
    token = env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN") or None
    with contextlib.suppress(OSError, ValueError):
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    if env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise _hub_hint(repo_id, "not in the local Hub cache and HF_HUB_OFFLINE is set")
    endpoint = env.get("HF_ENDPOINT") or "https://huggingface.co"
    proxy = env.get("HTTPS_PROXY") or env.get("https_proxy")
    reason = _probe(proxy or endpoint, PROBE_TIMEOUT_S)
    if reason:
        raise _hub_hint(repo_id, reason)
    logger.info("fetching %s from %s into %s", repo_id, endpoint, cache)
    try:
        options = {"revision": revision, "cache_dir": cache, "token": token, "endpoint": endpoint}
        path = _within(deadline, lambda: snapshot_download(repo_id, etag_timeout=10, **options))
    except (OSError, ValueError) as exc:
        if isinstance(exc, ModelLoadTimeout):
            raise
        raise _hub_hint(repo_id, f"{type(exc).__name__}: {exc}") from exc
    return Path(path)
