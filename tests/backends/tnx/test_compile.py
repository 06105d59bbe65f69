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
from neuron_lmi.backends.tnx import compile as neuron
from neuron_lmi.backends.tnx.args import NeuronCompileSpec
from neuron_lmi.cli import main


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
    model = neuron.compile_neuron_entry(mapped, "LlamaForCausalLM", out)

    (name, (path, kwargs, env)), *rest = fake_tnx.calls
    assert name == "from_pretrained" and path == str(tmp_path / "model")
    assert {k: kwargs[k] for k in ("batch_size", "tp_degree", "n_positions", "amp")} == {
        "batch_size": 4, "tp_degree": 8, "n_positions": 1024, "amp": "bf16"
    }  # fmt: skip
    assert kwargs["context_length_estimate"] == [256, 512]
    assert kwargs["neuron_config"]["continuous_batching"] == {
        "type": "ContinuousBatchingConfig", "args": (), "batch_size_for_shared_caches": 4
    }  # fmt: skip
    assert env == {"NEURON_COMPILE_CACHE_URL": str(cache.root / ".neuron-compile-cache"),
                   "NEURON_CC_FLAGS": "--auto-cast=none -O2"}  # fmt: skip
    assert rest == [("to_neuron", None), ("save", str(out))]
    assert isinstance(model, _Recorder)  # the compiled model comes back, ready to serve
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


def _weights(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    return model


def _key(spec: NeuronCompileSpec, tmp_path: Path) -> Any:
    mapped = neuron.plan_neuron_compile(spec, CompileCache(tmp_path / "store"), {})
    return neuron.neuron_key_inputs(
        spec, mapped, {"model_type": "llama"}, version="2.15", library_version="0.13"
    )


@pytest.mark.parametrize(
    "change",
    [
        {"fuse_qkv": True},
        {"quantize": "static_int8"},
        {"neuron_optimize_level": 3},
        {"enable_saturate_infinity": True},
        {"enable_mixed_precision_accumulation": True},
        {"dtype": "fp16"},
        {"context_length_estimate": (256,)},
        {"batch_size": 8},
        {"n_positions": 2048},
    ],
)
def test_key_covers_every_argument_passed_to_the_library(tmp_path: Path, change: dict[str, Any]) -> None:
    """A stale hit would fail only after the full weight load: every argument must change the key."""
    base = {"model_path": str(_weights(tmp_path)), "tp_degree": 8, "batch_size": 4, "n_positions": 1024,
            "dtype": "bf16"}  # fmt: skip
    before, after = (
        _key(NeuronCompileSpec(**base), tmp_path),
        _key(NeuronCompileSpec(**(base | change)), tmp_path),
    )
    assert before.key() != after.key()
    args = after.describe()["library_args"]
    assert set(args) == {"from_pretrained_kwargs", "neuron_config", "library", "library_version"}


def test_key_reports_the_gqa_strategy_the_library_runs(tmp_path: Path) -> None:
    """Under continuous batching shard-over-batch at tp 8 runs as shard-over-heads: same graphs, same key."""
    model = str(_weights(tmp_path))
    heads = {"n_query_heads": 64, "n_kv_heads": 8, "head_dim": 128}
    asked = _key(
        NeuronCompileSpec(model, 8, 32, 1024, group_query_attention="shard-over-batch", **heads), tmp_path
    )
    runs = _key(
        NeuronCompileSpec(model, 8, 32, 1024, group_query_attention="shard-over-heads", **heads), tmp_path
    )
    assert asked.gqa_strategy == "shard-over-heads"
    assert asked.key() == runs.key()
    at_24 = _key(
        NeuronCompileSpec(model, 24, 48, 1024, group_query_attention="shard-over-batch", **heads), tmp_path
    )
    assert at_24.gqa_strategy == "replicated-heads"


def test_key_needs_no_weights(tmp_path: Path) -> None:
    """NEFFs hold no weights: a dry run from a folder with only config.json computes serve's key."""
    with_weights = _weights(tmp_path)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    specs = [NeuronCompileSpec(str(m), 8, 4, 1024, "bf16") for m in (with_weights, config_only)]
    assert _key(specs[0], tmp_path).key() == _key(specs[1], tmp_path).key()


def test_compile_spec_from_config_takes_every_neuron_option(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The one spec builder serve and ``neuron-lmi compile --target neuron`` share."""
    import json

    from neuron_lmi.backends.tnx.args import compile_spec_from_config
    from neuron_lmi.config import load_config

    model = tmp_path / "config-only"  # a dry run's model folder may hold only config.json
    model.mkdir()
    hf = json.loads((tiny_llama_dir / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**hf, "max_position_embeddings": 8192}))
    props = tmp_path / "serving.properties"
    props.write_text(
        "option.tensor_parallel_degree=2\noption.max_rolling_batch_size=8\noption.dtype=bf16\n"
        "option.fuse_qkv=true\noption.quantize=static_int8\noption.neuron_optimize_level=3\n"
        "option.enable_saturate_infinity=true\noption.enable_mixed_precision_accumulation=true\n"
        "option.group_query_attention=shard-over-batch\n"
    )
    config = load_config(properties_path=props, env={}).config
    spec = compile_spec_from_config(config, str(model))
    assert (spec.tp_degree, spec.batch_size, spec.dtype) == (2, 8, "bf16")
    assert (spec.fuse_qkv, spec.quantize, spec.neuron_optimize_level) == (True, "static_int8", 3)
    assert spec.enable_saturate_infinity and spec.enable_mixed_precision_accumulation
    assert spec.n_positions == 4096  # LMI's default min(max_position_embeddings, 4096)
    n_q, n_kv = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    assert (spec.n_query_heads, spec.n_kv_heads) == (n_q, n_kv)
    assert spec.head_dim == hf.get("head_dim", hf["hidden_size"] // n_q)
    mapped = neuron.plan_neuron_compile(spec, CompileCache(tmp_path / "store"), {})
    assert mapped.gqa_strategy != "shard-over-batch" and "batch 1" in mapped.notes[0]
    assert (
        mapped.env["NEURON_CC_FLAGS"]
        == "-O3 --enable-saturate-infinity --enable-mixed-precision-accumulation"
    )


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
    from neuron_lmi.backends.tnx.args import build_neuron_config

    mapped = neuron.plan_neuron_compile(_spec(tmp_path), CompileCache(tmp_path), {})
    assert build_neuron_config(mapped) is not None
