"""``neuron-lmi package``: SageMaker layout (files at the archive root) and serving.properties checks."""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path

import pytest

from neuron_lmi.commands import package
from neuron_lmi.config import load_config, read_properties


def run_package(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    package.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["package", *argv])
    return args.func(args)


@pytest.fixture()
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    (folder / ".git").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref")
    (folder / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 2048}')
    (folder / "tokenizer.json").write_text("{}")
    blob = tmp_path / "blobs" / "abc123"  # Hub cache style: the weights file is a symlink to a blob
    blob.parent.mkdir()
    blob.write_bytes(b"\0" * 4096)
    (folder / "model.safetensors").symlink_to(blob)
    return folder


@pytest.fixture()
def compiled_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "neffs"
    (folder / "sub").mkdir(parents=True)
    (folder / "0123abcd.neff").write_bytes(b"neff")
    (folder / "sub" / "graph.neff").write_bytes(b"neff2")
    return folder


def test_archive_has_files_at_root_and_valid_properties(tmp_path, model_dir, compiled_dir) -> None:
    out = tmp_path / "out" / "model.tar.gz"
    code = run_package(
        "--model", str(model_dir), "--compiled", str(compiled_dir), "--out", str(out),
        "--option", "tensor_parallel_degree=2", "--option", "option.n_positions=1024",
        "--option", "option.rolling_batch=auto", "--option", "job_queue_size=64",
    )  # fmt: skip
    assert code == 0
    with tarfile.open(out) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert sorted(members) == [
            "compiled/0123abcd.neff",
            "compiled/sub/graph.neff",
            "config.json",
            "model.safetensors",
            "serving.properties",
            "tokenizer.json",
        ]
        assert members["model.safetensors"].isfile() and members["model.safetensors"].size == 4096
        assert all(m.uid == 0 and not m.name.startswith(("./", "/")) for m in members.values())
        properties = tar.extractfile("serving.properties").read().decode()  # type: ignore[union-attr]
        tar.extractall(tmp_path / "opt" / "ml" / "model", filter="data")
    assert "option.tensor_parallel_degree=2\n" in properties
    assert "option.compiled_graph_path=/opt/ml/model/compiled\n" in properties
    assert "job_queue_size=64\n" in properties and "option.model_id" not in properties
    # what the server will do inside the container: the unpacked folder is the model
    unpacked = tmp_path / "opt" / "ml" / "model"
    resolved = load_config(None, None, {"NEURON_LMI_SAGEMAKER_ROOT": str(unpacked.parent)})
    assert resolved.config.model.model_id == str(unpacked)
    assert resolved.config.parallel.tensor_parallel_degree == 2
    assert resolved.config.batching.n_positions == 1024


def test_gguf_into_directory_with_properties_file(tmp_path) -> None:
    gguf = tmp_path / "smol.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    props = tmp_path / "in.properties"
    props.write_text("# from LMI docs\nengine=Python\noption.dtype=fp32\noption.max_rolling_batch_size=8\n")
    out = tmp_path / "pkg"
    assert run_package("--model", str(gguf), "--properties", str(props), "--out", str(out)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["serving.properties", "smol.gguf"]
    written = read_properties(out / "serving.properties")
    assert written["option.dtype"] == "fp32" and written["option.max_rolling_batch_size"] == "8"


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ("option.tensor_parallel_degree=three", "tensor_parallel_degree"),
        ("option.dtype=int3", "dtype"),
        ("option.model_id=/home/me/llama", "option.model_id"),
        ("no-equals-sign", "KEY=VALUE"),
    ],
)
def test_bad_properties_are_rejected(tmp_path, model_dir, option, match) -> None:
    out = tmp_path / "model.tar.gz"
    with pytest.raises(ValueError, match=match):
        run_package("--model", str(model_dir), "--option", option, "--out", str(out))
    assert not out.exists()


def test_inputs_are_checked(tmp_path, model_dir) -> None:
    with pytest.raises(FileNotFoundError):
        run_package("--model", str(tmp_path / "missing"), "--out", str(tmp_path / "m.tar.gz"))
    with pytest.raises(ValueError, match="outside"):
        run_package("--model", str(model_dir), "--out", str(model_dir / "model.tar.gz"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        run_package("--model", str(tmp_path / "empty"), "--out", str(tmp_path / "m.tar.gz"))


def test_builtin_model_name_is_packaged_like_serve_resolves_it(tmp_path, smollm2_gguf) -> None:
    out = tmp_path / "opt" / "ml" / "model"
    option = "option.max_rolling_batch_size=4"
    assert run_package("--model", "smollm2", "--option", option, "--out", str(out)) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([smollm2_gguf.name, "serving.properties"])
    assert (out / smollm2_gguf.name).stat().st_size == smollm2_gguf.stat().st_size
    resolved = load_config(None, None, {"NEURON_LMI_SAGEMAKER_ROOT": str(out.parent)})
    assert resolved.config.model.model_id == str(out)  # the folder holding the .gguf is the model
    assert resolved.config.batching.max_rolling_batch_size == 4


@pytest.mark.parametrize("value", ["/opt/ml/model", "/opt/ml/model/"])
def test_lmi_model_id_for_uncompressed_artifacts_is_kept(tmp_path, model_dir, value) -> None:
    """LMI's uncompressed-artifact idiom: ``option.model_id=/opt/ml/model`` beside the weights."""
    props = tmp_path / "lmi.properties"
    props.write_text(f"engine=Python\noption.model_id={value}\noption.tensor_parallel_degree=2\n")
    out = tmp_path / "pkg"
    assert run_package("--model", str(model_dir), "--properties", str(props), "--out", str(out)) == 0
    written = read_properties(out / "serving.properties")
    assert written["option.model_id"] == value and written["option.tensor_parallel_degree"] == "2"
    assert (out / "model.safetensors").is_file()


def test_unknown_keys_are_kept_with_a_warning_as_serve_does(
    tmp_path, model_dir, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "pkg"
    with caplog.at_level("WARNING", logger="neuron_lmi.commands.package"):
        code = run_package(
            "--model", str(model_dir), "--out", str(out), "--option", "option.n_positions=512",
            "--option", "option.entryPoint=djl_python.transformers_neuronx",
        )  # fmt: skip
    assert code == 0
    assert "option.entryPoint" in caplog.text and "does not support" in caplog.text
    written = read_properties(out / "serving.properties")
    assert written["option.entryPoint"] == "djl_python.transformers_neuronx"  # LMI still sees it
    assert written["option.n_positions"] == "512"
    # serve reads the packaged file the same way: the key is ignored with a warning, not an error
    env = {"NEURON_LMI_SAGEMAKER_ROOT": str(tmp_path / "no")}
    resolved = load_config(None, out / "serving.properties", env)
    assert "option.entryPoint" in resolved.ignored and resolved.config.batching.n_positions == 512
