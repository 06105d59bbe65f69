"""A real S3-compatible server on loopback for model-source tests.

moto's WSGI app served by werkzeug on 127.0.0.1 (the stack ``moto_server`` runs), wrapped in a
recorder that logs every request and can inject faults into GET responses: cut the body half-way,
corrupt a byte, or trickle it out slowly. boto3 itself is never mocked.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest


class Recorder:
    """WSGI middleware: records (method, path, Range) and applies queued faults to GETs of a path."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.requests: list[tuple[str, str, str | None]] = []
        self.faults: dict[str, list[str]] = {}
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        method, path = environ["REQUEST_METHOD"], environ["PATH_INFO"]
        with self.lock:
            self.requests.append((method, path, environ.get("HTTP_RANGE")))
            queued = self.faults.get(path) if method == "GET" else None
            fault = queued.pop(0) if queued else None
        body = self.app(environ, start_response)
        if fault is None:
            return body
        data = b"".join(body)
        if fault == "corrupt":
            return [bytes([data[0] ^ 0xFF]) + data[1:]]
        if fault == "truncate":
            return _cut(data)
        if fault == "slow":
            return _trickle(data)
        raise ValueError(f"unknown fault {fault!r}")

    def object_gets(self, bucket: str, key: str) -> list[str | None]:
        """The Range header of every GET of ``bucket/key`` (None for a whole-object GET)."""
        with self.lock:
            return [rng for m, p, rng in self.requests if m == "GET" and p == f"/{bucket}/{key}"]

    def any_object_get(self, bucket: str) -> bool:
        with self.lock:
            return any(m == "GET" and p.startswith(f"/{bucket}/") for m, p, _ in self.requests)


def _cut(data: bytes) -> Iterator[bytes]:
    yield data[: len(data) // 2]
    raise ConnectionAbortedError("fault injected: connection cut mid-body")


def _trickle(data: bytes) -> Iterator[bytes]:
    step = 1 << 20
    for start in range(0, len(data), step):
        yield data[start : start + step]
        time.sleep(1.0)


@dataclass
class S3Server:
    url: str
    recorder: Recorder

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.url,
            **extra,
        }

    def upload(self, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
        client = self.client()
        for rel, data in files.items():
            client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=data)

    def client(self, **config: Any) -> Any:
        import boto3
        from botocore.config import Config

        env = self.env()
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=env["AWS_DEFAULT_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            config=Config(**config),
        )


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    recorder = Recorder(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, recorder, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield S3Server(f"http://127.0.0.1:{server.server_port}", recorder)
    finally:
        server.shutdown()
        thread.join(timeout=10)


MODEL_FILES = {
    "config.json": b'{"model_type": "llama", "max_position_embeddings": 512}',
    "tokenizer.json": b'{"version": "1.0"}' * 50,
    "model.safetensors": bytes(range(256)) * 4096,  # 1 MiB
}


@pytest.fixture()
def bucket(s3_server: S3Server) -> str:
    name = f"models-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name
