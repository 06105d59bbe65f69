"""S3 model sources against a real S3 server on loopback: mirror, reuse, resume, verify, time out."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from neuron_lmi.model_source import ModelLoadTimeout, ModelSourceError, fetch_model, verify_file

pytestmark = pytest.mark.s3

MODEL_FILES = {
    "config.json": b'{"model_type": "llama", "max_position_embeddings": 512}',
    "tokenizer.json": b'{"version": "1.0"}' * 50,
    "model.safetensors": bytes(range(256)) * 4096,  # 1 MiB
}


def test_s3_prefix_is_mirrored_and_reused_without_download(s3_server, bucket, tmp_path: Path):
    s3_server.upload(bucket, "llama/tiny", MODEL_FILES)
    uri = f"s3://{bucket}/llama/tiny"

    path = fetch_model(uri, tmp_path, timeout_s=60, env=s3_server.env())

    assert path == tmp_path / "s3" / bucket / "llama" / "tiny"
    assert {p.name: p.read_bytes() for p in path.iterdir()} == MODEL_FILES
    assert len(s3_server.recorder.object_gets(bucket, "llama/tiny/model.safetensors")) == 1
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    s3_server.recorder.requests.clear()

    again = fetch_model(uri, tmp_path, timeout_s=60, env=s3_server.env())

    assert again == path
    assert not s3_server.recorder.any_object_get(bucket)  # listing only, no object GET
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes


def test_s3_single_object_and_endpoint_s3_variable(s3_server, bucket, tmp_path: Path):
    s3_server.client().put_object(Bucket=bucket, Key="gguf/m.gguf", Body=b"GGUF" + b"\0" * 100)
    env = s3_server.env(AWS_ENDPOINT_URL="http://127.0.0.1:9", AWS_ENDPOINT_URL_S3=s3_server.url)

    path = fetch_model(f"s3://{bucket}/gguf/m.gguf", tmp_path, None, env)

    assert path == tmp_path / "s3" / bucket / "gguf" / "m.gguf"
    assert path.read_bytes() == b"GGUF" + b"\0" * 100


def test_s3_changed_prefix_refetches_changed_files_and_drops_removed_ones(s3_server, bucket, tmp_path: Path):
    s3_server.upload(bucket, "m", MODEL_FILES)
    path = fetch_model(f"s3://{bucket}/m", tmp_path, 60, s3_server.env())
    s3_server.client().delete_object(Bucket=bucket, Key="m/tokenizer.json")
    s3_server.upload(bucket, "m", {"config.json": b'{"model_type": "mistral"}'})
    s3_server.recorder.requests.clear()

    fetch_model(f"s3://{bucket}/m", tmp_path, 60, s3_server.env())

    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert (path / "config.json").read_bytes() == b'{"model_type": "mistral"}'
    assert s3_server.recorder.object_gets(bucket, "m/model.safetensors") == []


def test_s3_cut_transfer_resumes_with_range_in_the_same_call(s3_server, bucket, tmp_path: Path):
    s3_server.upload(bucket, "m", MODEL_FILES)
    s3_server.recorder.faults[f"/{bucket}/m/model.safetensors"] = ["truncate"]

    path = fetch_model(f"s3://{bucket}/m", tmp_path, 60, s3_server.env())

    assert (path / "model.safetensors").read_bytes() == MODEL_FILES["model.safetensors"]
    ranges = s3_server.recorder.object_gets(bucket, "m/model.safetensors")
    assert ranges[0] is None
    assert len(ranges) == 2 and ranges[1] is not None and ranges[1].startswith("bytes=")
    assert int(ranges[1].removeprefix("bytes=").rstrip("-")) > 0


def test_s3_interrupted_download_leaves_part_file_and_next_start_resumes(s3_server, bucket, tmp_path: Path):
    s3_server.upload(bucket, "m", MODEL_FILES)
    key = f"/{bucket}/m/model.safetensors"
    s3_server.recorder.faults[key] = ["truncate"] * 3

    with pytest.raises(ModelSourceError, match="interrupted"):
        fetch_model(f"s3://{bucket}/m", tmp_path, 60, s3_server.env())

    part = tmp_path / "s3" / bucket / "m" / "model.safetensors.part"
    have = part.stat().st_size
    assert 0 < have < len(MODEL_FILES["model.safetensors"])
    assert not (tmp_path / "s3" / bucket / "m" / "model.safetensors").exists()
    s3_server.recorder.requests.clear()

    path = fetch_model(f"s3://{bucket}/m", tmp_path, 60, s3_server.env())

    assert (path / "model.safetensors").read_bytes() == MODEL_FILES["model.safetensors"]
    assert s3_server.recorder.object_gets(bucket, "m/model.safetensors") == [f"bytes={have}-"]
    assert s3_server.recorder.object_gets(bucket, "m/config.json") == []  # finished files are reused
    assert not part.exists()


def test_s3_corrupt_partial_is_detected_by_etag_and_downloaded_again(
    s3_server, bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    s3_server.upload(bucket, "m", MODEL_FILES)
    folder = tmp_path / "s3" / bucket / "m"
    folder.mkdir(parents=True)
    (folder / "model.safetensors.part").write_bytes(b"\x00" * 1000)  # wrong bytes, plausible length

    with caplog.at_level(logging.WARNING, logger="neuron_lmi.model_source"):
        path = fetch_model(f"s3://{bucket}/m", tmp_path, 60, s3_server.env())

    assert (path / "model.safetensors").read_bytes() == MODEL_FILES["model.safetensors"]
    assert s3_server.recorder.object_gets(bucket, "m/model.safetensors") == ["bytes=1000-", None]
    assert "ETag mismatch" in caplog.text and "resumed from a partial file" in caplog.text


def test_s3_corrupt_bytes_from_server_raise_etag_mismatch(s3_server, bucket, tmp_path: Path):
    # Uploaded without a flexible checksum, so the ETag (MD5) is the only integrity check.
    plain = s3_server.client(request_checksum_calculation="when_required")
    plain.put_object(Bucket=bucket, Key="m/model.safetensors", Body=MODEL_FILES["model.safetensors"])
    s3_server.recorder.faults[f"/{bucket}/m/model.safetensors"] = ["corrupt"] * 3

    with pytest.raises(ModelSourceError, match=r"ETag mismatch for model\.safetensors") as info:
        fetch_model(f"s3://{bucket}/m", tmp_path, 60, s3_server.env())

    expected = hashlib.md5(MODEL_FILES["model.safetensors"]).hexdigest()
    assert expected in str(info.value) and f"s3://{bucket}/m/model.safetensors" in str(info.value)
    assert len(s3_server.recorder.object_gets(bucket, "m/model.safetensors")) == 3
    folder = tmp_path / "s3" / bucket / "m"
    assert not (folder / "model.safetensors").exists()
    assert not (folder / "model.safetensors.part").exists()


def test_s3_corrupt_bytes_with_stored_checksum_raise_checksum_mismatch(s3_server, bucket, tmp_path: Path):
    s3_server.upload(bucket, "m", MODEL_FILES)  # boto3 stores a CRC32 with each object
    s3_server.recorder.faults[f"/{bucket}/m/model.safetensors"] = ["corrupt"] * 3

    with pytest.raises(ModelSourceError, match=r"checksum mismatch for model\.safetensors") as info:
        fetch_model(f"s3://{bucket}/m", tmp_path, 60, s3_server.env())

    assert f"s3://{bucket}/m/model.safetensors" in str(info.value)
    folder = tmp_path / "s3" / bucket / "m"
    assert not (folder / "model.safetensors").exists()
    assert not (folder / "model.safetensors.part").exists()


def test_s3_multipart_object_is_checked_by_size(s3_server, bucket, tmp_path: Path):
    from boto3.s3.transfer import TransferConfig

    data = bytes(range(251)) * (6 * 1024 * 1024 // 251 + 1)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    chunks = TransferConfig(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    s3_server.client().upload_file(str(source), bucket, "big/weights.bin", Config=chunks)
    s3_server.client().put_object(Bucket=bucket, Key="big/config.json", Body=b"{}")

    path = fetch_model(f"s3://{bucket}/big", tmp_path / "cache", 60, s3_server.env())

    assert (path / "weights.bin").read_bytes() == data


def test_s3_timeout_names_the_model_and_keeps_the_partial_file(s3_server, bucket, tmp_path: Path):
    data = bytes(range(256)) * (8 * 4096)  # 8 MiB, trickled 1 MiB per second
    s3_server.client().put_object(Bucket=bucket, Key="slow/model.safetensors", Body=data)
    s3_server.recorder.faults[f"/{bucket}/slow/model.safetensors"] = ["slow"]
    uri = f"s3://{bucket}/slow"

    with pytest.raises(TimeoutError, match=uri) as info:
        fetch_model(uri, tmp_path, timeout_s=2.5, env=s3_server.env())

    assert isinstance(info.value, ModelLoadTimeout)
    part = tmp_path / "s3" / bucket / "slow" / "model.safetensors.part"
    have = part.stat().st_size
    assert 0 < have < len(data)
    path = fetch_model(uri, tmp_path, timeout_s=60, env=s3_server.env())
    assert (path / "model.safetensors").read_bytes() == data
    assert s3_server.recorder.object_gets(bucket, "slow/model.safetensors")[-1] == f"bytes={have}-"


def test_s3_missing_prefix_is_a_clear_error(s3_server, bucket, tmp_path: Path):
    with pytest.raises(ModelSourceError, match=f"s3://{bucket}/nothing/here.*no objects"):
        fetch_model(f"s3://{bucket}/nothing/here", tmp_path, 60, s3_server.env())


def test_verify_file_reports_size_and_etag_mismatch(tmp_path: Path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"abc")
    good = hashlib.md5(b"abc").hexdigest()
    assert verify_file(path, 3, good) is None
    assert "size mismatch" in (verify_file(path, 4, good) or "")
    assert f"expected {'0' * 32}" in (verify_file(path, 3, "0" * 32) or "")
    assert verify_file(path, 3, "0123-2") is None  # multipart ETag: size only
    assert verify_file(path, 3, "0" * 32, encryption="aws:kms") is None  # KMS ETag is not an MD5
