"""fetch_model for built-in names, local paths, unusable ids, and Hub ids failing fast."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from neuron_lmi.model_source import ModelSourceError, fetch_model


def test_local_directory_and_gguf_file_are_returned(tmp_path: Path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    assert fetch_model(str(model), tmp_path / "cache", None, {}) == model.resolve()
    assert fetch_model(str(gguf), tmp_path / "cache", None, {}) == gguf.resolve()


def test_builtin_smollm2_resolves_to_its_gguf(tmp_path: Path):
    path = fetch_model("smollm2", tmp_path, None, {})
    assert path.suffix == ".gguf" and path.is_file()


@pytest.mark.parametrize(
    ("model_id", "message"),
    [
        ("gs://bucket/model", "unsupported scheme"),
        ("./no/such/dir", "not a built-in name"),
        ("justaname", "smollm2"),
        ("s3://", "expected s3://bucket/prefix"),
    ],
)
def test_unusable_ids_are_clear_errors(tmp_path: Path, model_id: str, message: str):
    with pytest.raises(ModelSourceError, match=message) as info:
        fetch_model(model_id, tmp_path, None, {})
    assert model_id in str(info.value)


def test_local_directory_without_a_model_is_rejected(tmp_path: Path):
    with pytest.raises(ModelSourceError, match=r"config\.json"):
        fetch_model(str(tmp_path), tmp_path / "cache", None, {})


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_hub_id_fails_fast_offline_naming_the_id(tmp_path: Path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    with pytest.raises(ModelSourceError) as info:
        fetch_model("neuron-lmi-test/no-such-model", tmp_path, 60, env)
    text = str(info.value)
    assert "neuron-lmi-test/no-such-model" in text and "HF_HUB_OFFLINE" in text
    assert "local path" in text and "s3://" in text


def test_hub_id_fails_fast_when_the_hub_is_unreachable(tmp_path: Path):
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}", "HF_HUB_CACHE": str(tmp_path / "hub")}
    with pytest.raises(ModelSourceError) as info:
        fetch_model("neuron-lmi-test/no-such-model", tmp_path, 60, env)
    assert "neuron-lmi-test/no-such-model" in str(info.value) and "cannot reach" in str(info.value)


def test_hub_id_without_endpoint_override_raises_naming_the_id(tmp_path: Path):
    # No network here: the probe fails in seconds. With network, the Hub answers 401/404: same error.
    with pytest.raises(ModelSourceError, match="neuron-lmi-test/no-such-model"):
        fetch_model("neuron-lmi-test/no-such-model", tmp_path, 60, {"HF_HUB_CACHE": str(tmp_path / "hub")})


def test_hub_id_found_in_the_local_cache_needs_no_network(tmp_path: Path):
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}

    assert fetch_model("org/tiny", tmp_path, 60, env) == snapshot
