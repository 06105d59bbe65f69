"""The S3 mirror against a real S3-compatible server (moto's server mode) on loopback; no boto3 mocks."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from compile_cache.errors import EntryNotFoundError, RemoteError
from compile_cache.store import CompileCache
from neuron_lmi.cli import main

pytestmark = pytest.mark.s3
BUCKET = "neuron-lmi-cache"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture()
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh bucket; returns the cache URL. Credentials are dummies that only moto accepts."""
    import boto3

    for name, value in {
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    bucket = f"{BUCKET}-{abs(hash(request.node.name)) % 10**8}"
    client.create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/team/compiled"
    for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        client.delete_object(Bucket=bucket, Key=obj["Key"])
    client.delete_bucket(Bucket=bucket)


def _objects(url: str) -> list[str]:
    import boto3

    bucket = url.removeprefix("s3://").split("/")[0]
    return sorted(o["Key"] for o in boto3.client("s3").list_objects_v2(Bucket=bucket).get("Contents", []))


def test_push_delete_pull_verify(tmp_path: Path, s3: str, inputs, compile_fn) -> None:
    local = CompileCache(tmp_path / "a")
    entry = local.get_or_compile(inputs, compile_fn)
    remote = CompileCache(tmp_path / "a", remote=s3)
    assert remote.push() == {inputs.key(): "pushed"}
    assert remote.push(inputs.key()) == {inputs.key(): "already-remote"}
    prefix = f"team/compiled/cpu-2.5.1/{inputs.key()}/"
    assert _objects(s3) == [prefix + n for n in ("manifest.json", "model.pt2", "neff/bucket_128.neff")]

    shutil.rmtree(tmp_path / "a")
    assert remote.lookup(inputs) is None
    assert remote.pull(inputs.key()[:10]) == {inputs.key(): "pulled"}
    assert remote.verify(inputs.key()).ok
    pulled = remote.lookup(inputs)
    assert pulled is not None and pulled.manifest.files == entry.manifest.files
    assert pulled.file("model.pt2").read_bytes() == compile_fn.payload
    assert remote.pull() == {inputs.key(): "already-local"}


def test_get_or_compile_pushes_after_and_pulls_before(tmp_path: Path, s3: str, inputs, make_compile) -> None:
    first, second = make_compile(), make_compile()
    CompileCache(tmp_path / "host1", remote=s3).get_or_compile(inputs, first)
    assert f"team/compiled/cpu-2.5.1/{inputs.key()}/manifest.json" in _objects(s3)
    entry = CompileCache(tmp_path / "host2", remote=s3).get_or_compile(inputs, second, no_compile=True)
    assert (first.calls, second.calls) == (1, 0)
    assert entry.path.parent.parent == tmp_path / "host2"
    assert CompileCache(tmp_path / "host2").verify(entry.key).ok


def test_damaged_remote_entry_is_never_installed(tmp_path: Path, s3: str, inputs, compile_fn) -> None:
    import boto3

    CompileCache(tmp_path / "a", remote=s3).get_or_compile(inputs, compile_fn)
    bucket = s3.removeprefix("s3://").split("/")[0]
    key = f"team/compiled/cpu-2.5.1/{inputs.key()}/model.pt2"
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=b"tampered")
    other = CompileCache(tmp_path / "b", remote=s3)
    with pytest.raises(RemoteError, match=r"model\.pt2"):
        other.pull(inputs.key())
    assert other.lookup(inputs) is None
    assert not list((tmp_path / "b" / "cpu-2.5.1").glob(".tmp-*"))
    # get_or_compile logs the bad remote and compiles locally instead
    assert other.get_or_compile(inputs, compile_fn).key == inputs.key() and compile_fn.calls == 2


def test_pull_unknown_key_and_unreachable_remote(tmp_path: Path, s3: str) -> None:
    with pytest.raises(EntryNotFoundError):
        CompileCache(tmp_path, remote=s3).pull("abcdef")
    with pytest.raises(RemoteError, match=r"NoSuchBucket|does not exist"):
        CompileCache(tmp_path, remote="s3://no-such-bucket-here/x").pull()


def test_cli_push_and_pull(tmp_path: Path, s3: str, inputs, compile_fn, capsys) -> None:
    CompileCache(tmp_path / "a").get_or_compile(inputs, compile_fn)
    assert main(["cache", "push", "--cache-dir", str(tmp_path / "a"), "--cache-url", s3]) == 0
    assert f"{inputs.key()}  pushed" in capsys.readouterr().out
    args = ["cache", "pull", inputs.key(), "--cache-dir", str(tmp_path / "b"), "--cache-url", s3, "--json"]
    assert main(args) == 0
    assert f'"{inputs.key()}": "pulled"' in capsys.readouterr().out
    assert main(["cache", "verify", "--cache-dir", str(tmp_path / "b")]) == 0
    assert main(["cache", "pull", "--cache-dir", str(tmp_path / "b")]) == 2
    assert "no remote configured" in capsys.readouterr().err
