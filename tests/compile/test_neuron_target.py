"""The neuron target: the mapping compile hands transformers-neuronx, checked against a stand-in
library; the real library is exercised only where it imports."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest

from compile_cache import CompileCache
from neuron_lmi.backends.neuron_args import NeuronCompileSpec
from neuron_lmi.cli import main
from neuron_lmi.compile import neuron


class _Recorder:
    """Stands in for ``LlamaForSampling``: records what compile called, in order."""

    calls: ClassVar[list[tuple[str, Any]]] = []

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> _Recorder:
        env = {k: os.environ.get(k) for k in ("NEURON_COMPILE_CACHE_URL", "NEURON_CC_FLAGS")}
        cls.calls.append(("from_pretrained", (path, kwargs, env)))
        return cls()

    def to_neuron(self) -> None:
        self.calls.append(("to_neuron", None))

    def save(self, directory: str) -> None:
        self.calls.append(("save", directory))
        (Path(directory) / "abc123.neff").write_bytes(b"neff")

    def load(self, directory: str) -> None:
        self.calls.append(("load", directory))


@pytest.fixture()
def fake_tnx(monkeypatch: pytest.MonkeyPatch) -> type[_Recorder]:
    """A minimal ``transformers_neuronx`` exposing the names compile uses."""
    root = types.ModuleType("transformers_neuronx")
    config = types.ModuleType("transformers_neuronx.config")
    llama = types.ModuleType("transformers_neuronx.llama.model")

    def record(name: str) -> Any:
        return lambda *a, **k: {"type": name, "args": a, **k}

    root.NeuronConfig, root.QuantizationConfig = record("NeuronConfig"), record("QuantizationConfig")
    root.GQA = record("GQA")
    config.ContinuousBatchingConfig = record("ContinuousBatchingConfig")
    llama.LlamaForSampling = _Recorder
    for name, module in (("", root), (".config", config), (".llama", types.ModuleType("x")),
                         (".llama.model", llama)):  # fmt: skip
        monkeypatch.setitem(sys.modules, "transformers_neuronx" + name, module)
    _Recorder.calls = []
    return _Recorder


def _spec(tmp_path: Path) -> NeuronCompileSpec:
    return NeuronCompileSpec(
        model_path=str(tmp_path / "model"), tp_degree=8, batch_size=4, n_positions=1024, dtype="bf16",
        context_length_estimate=(256, 512), group_query_attention="shard-over-heads",
        neuron_optimize_level=2,
    )  # fmt: skip


def test_compile_passes_the_mapped_arguments(
    fake_tnx: type[_Recorder], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)
    cache = CompileCache(tmp_path / "store")
    mapped = neuron.plan_neuron_compile(_spec(tmp_path), cache, {"NEURON_CC_FLAGS": "--auto-cast=none -O1"})
    out = tmp_path / "entry"
    out.mkdir()
    neuron.compile_neuron_entry(mapped, "LlamaForCausalLM", out)

    (name, (path, kwargs, env)), *rest = fake_tnx.calls
    assert name == "from_pretrained" and path == str(tmp_path / "model")
    assert {k: kwargs[k] for k in ("batch_size", "tp_degree", "n_positions", "amp")} == {
        "batch_size": 4, "tp_degree": 8, "n_positions": 1024, "amp": "bf16"
    }  # fmt: skip
    assert kwargs["context_length_estimate"] == [256, 512]
    assert kwargs["neuron_config"]["continuous_batching"]["max_num_seqs"] == 4
    assert env == {"NEURON_COMPILE_CACHE_URL": str(cache.root / ".neuron-compile-cache"),
                   "NEURON_CC_FLAGS": "--auto-cast=none -O2"}  # fmt: skip
    assert rest == [("to_neuron", None), ("save", str(out))]
    assert "NEURON_COMPILE_CACHE_URL" not in os.environ  # restored after the compile
    record = json.loads((out / "neuron.json").read_text())
    assert record["from_pretrained_kwargs"]["tp_degree"] == 8


def test_remote_store_points_the_neuron_cache_at_s3(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path, remote="s3://bucket/prefix", s3_client=object())
    assert neuron.neuron_cache_url(cache) == "s3://bucket/prefix/.neuron-compile-cache"


def test_key_changes_with_tp_and_gqa(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    cache = CompileCache(tmp_path / "store")
    keys = set()
    for tp, gqa in ((8, "shard-over-heads"), (2, "shard-over-heads"), (8, "replicated-heads")):
        spec = NeuronCompileSpec(str(model), tp, 4, 1024, "bf16", group_query_attention=gqa)
        mapped = neuron.plan_neuron_compile(spec, cache, {})
        keys.add(neuron.neuron_key_inputs(spec, mapped, {"model_type": "llama"}, version="2.15").key())
    assert len(keys) == 3


def test_unknown_architecture_is_rejected() -> None:
    with pytest.raises(ValueError, match="GPT2"):
        neuron.sampling_class_path("GPT2LMHeadModel")


def test_without_the_library_compile_says_what_to_install(tmp_path: Path) -> None:
    if importlib.util.find_spec("transformers_neuronx") is not None:
        pytest.skip("transformers-neuronx is importable here")
    mapped = neuron.plan_neuron_compile(_spec(tmp_path), CompileCache(tmp_path), {})
    with pytest.raises(RuntimeError, match="Neuron SDK"):
        neuron.compile_neuron_entry(mapped, "LlamaForCausalLM", tmp_path)


def test_cli_neuron_target_fails_clearly_without_the_sdk(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compile", "--model", str(tiny_llama_dir), "--target", "neuron", "--tensor-parallel-degree", "2",
            "--n-positions", "256", "--cache-dir", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    assert "neuron" in capsys.readouterr().err.lower()


def test_real_library_builds_the_config(tmp_path: Path) -> None:
    pytest.importorskip(
        "transformers_neuronx", reason="transformers-neuronx (AWS Neuron SDK) is not installed"
    )
    from neuron_lmi.backends.neuron_args import build_neuron_config

    mapped = neuron.plan_neuron_compile(_spec(tmp_path), CompileCache(tmp_path), {})
    assert build_neuron_config(mapped) is not None
