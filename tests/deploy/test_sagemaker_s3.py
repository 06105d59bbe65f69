"""S3 uploads of model.tar.gz and of an uncompressed prefix, against a real S3-compatible server
(moto's) on 127.0.0.1: nothing leaves the machine."""

from __future__ import annotations

import socket
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from neuron_lmi.cli import main
from neuron_lmi.deploy.sagemaker import upload_archive, upload_directory
from neuron_lmi.deploy.sagemaker.cli import build_parser

REGION = "us-east-1"
CREDS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": REGION}


def client(service: str, **kwargs: Any) -> Any:
    return boto3.client(service, **CREDS, **kwargs)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.mark.s3
def test_upload_archive_and_prefix_to_local_s3(tmp_path: Path, s3_endpoint: str) -> None:
    s3 = client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="models")
    folder = tmp_path / "pkg"
    (folder / "compiled").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "serving.properties").write_text("engine=Python\n")
    (folder / "compiled" / "a.neff").write_bytes(b"x" * 1000)
    archive = tmp_path / "model.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted(folder.rglob("*")):
            tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)

    assert upload_archive(s3, archive, "s3://models/llama/") == "s3://models/llama/model.tar.gz"
    fetched = s3.get_object(Bucket="models", Key="llama/model.tar.gz")["Body"].read()
    assert fetched == archive.read_bytes()

    assert upload_directory(s3, folder, "s3://models/llama/raw") == "s3://models/llama/raw/"
    listed = s3.list_objects_v2(Bucket="models", Prefix="llama/raw/")["Contents"]
    assert sorted(o["Key"] for o in listed) == [
        "llama/raw/compiled/a.neff",
        "llama/raw/config.json",
        "llama/raw/serving.properties",
    ]
    # the CLI path, against the same local server
    code = build_parser().parse_args(
        [
            "--region",
            REGION,
            "upload",
            "--path",
            str(archive),
            "--s3",
            "s3://models/cli.tar.gz",
            "--endpoint-url",
            s3_endpoint,
        ]
    )
    monkey_env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in monkey_env.items():
            mp.setenv(key, value)
        assert code.func(code) == 0
    assert s3.head_object(Bucket="models", Key="cli.tar.gz")["ContentLength"] == archive.stat().st_size


@pytest.mark.s3
def test_upload_refuses_a_prefix_that_already_holds_objects(
    tmp_path: Path, s3_endpoint: str, monkeypatch, capsys
) -> None:
    """SageMaker copies every object under an uncompressed prefix into /opt/ml/model: a stale shard or
    serving.properties from an earlier upload would be served beside the new files."""
    s3 = client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket="reuse")
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    new.mkdir()
    (old / "model-00002-of-00002.safetensors").write_bytes(b"old shard")
    (new / "model.safetensors").write_bytes(b"new weights")
    assert upload_directory(s3, old, "s3://reuse/llama") == "s3://reuse/llama/"

    with pytest.raises(ValueError, match=r"s3://reuse/llama/ is not empty .*model-00002-of-00002"):
        upload_directory(s3, new, "s3://reuse/llama/")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="reuse")["Contents"]]
    assert keys == ["llama/model-00002-of-00002.safetensors"], "nothing uploaded after the refusal"

    # a sibling prefix sharing the name's start is a different prefix
    assert upload_directory(s3, new, "s3://reuse/llama-v2/") == "s3://reuse/llama-v2/"

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    argv = ["deploy", "--region", REGION, "upload", "--path", str(new), "--s3", "s3://reuse/llama/"]
    assert main([*argv, "--endpoint-url", s3_endpoint]) == 2
    assert "is not empty" in capsys.readouterr().err
