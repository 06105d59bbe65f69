"""NxD Inference artifacts through the compile cache (``NxdiBackend``: plan -> compile -> load),
against stand-in library modules.

The stand-ins record what the backend constructs and calls (``NeuronConfig(**kwargs)``,
``LlamaInferenceConfig(neuron_config, load_config=…)``, ``NeuronLlamaForCausalLM(path, config)``,
``compile(dir)``, ``load(dir)``) with the files ``compile`` writes; the real library is not on PyPI.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from compile_cache import CompileCache
from neuron_lmi.backends.backend import CompileOptions, load_runner
from neuron_lmi.backends.nxdi.artifacts import is_artifact_dir, nxdi_key_inputs
from neuron_lmi.backends.nxdi.backend import NXDI_BACKEND, NxdiBuildPlan
from neuron_lmi.backends.registry import BuildRequest
from neuron_lmi.config import load_config

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 512,
}  # fmt: skip


class Recorder:
    built: ClassVar[list[Any]] = []
    compiled: ClassVar[list[str]] = []
    loaded: ClassVar[list[str]] = []


class NeuronConfig:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class OnDeviceSamplingConfig:  # the library's: the sampling defaults compiled into the graphs
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class LlamaInferenceConfig:
    def __init__(self, neuron_config: NeuronConfig, load_config: Any = None) -> None:
        self.neuron_config = neuron_config
        self.loaded_from = load_config


class NeuronLlamaForCausalLM:
    def __init__(self, model_path: str, config: LlamaInferenceConfig) -> None:
        self.model_path, self.config = model_path, config
        Recorder.built.append(self)

    def compile(self, path: str) -> None:
        Recorder.compiled.append(path)
        out = Path(path)
        (out / "neuron_config.json").write_text(
            json.dumps({"tp": self.config.neuron_config.kwargs["tp_degree"]})
        )
        (out / "model.pt").write_bytes(b"traced")

    def load(self, path: str) -> None:
        if not is_artifact_dir(Path(path)):
            raise FileNotFoundError(path)
        Recorder.loaded.append(path)


@pytest.fixture()
def library(monkeypatch: pytest.MonkeyPatch) -> type[Recorder]:
    Recorder.built, Recorder.compiled, Recorder.loaded = [], [], []
    modules = {
        "neuronx_distributed_inference": types.ModuleType("neuronx_distributed_inference"),
        "neuronx_distributed_inference.models.config": types.ModuleType("config"),
        "neuronx_distributed_inference.models.llama.modeling_llama": types.ModuleType("modeling_llama"),
        "neuronx_distributed_inference.utils.hf_adapter": types.ModuleType("hf_adapter"),
    }
    config_module = modules["neuronx_distributed_inference.models.config"]
    config_module.NeuronConfig, config_module.OnDeviceSamplingConfig = NeuronConfig, OnDeviceSamplingConfig
    llama = modules["neuronx_distributed_inference.models.llama.modeling_llama"]
    llama.LlamaInferenceConfig, llama.NeuronLlamaForCausalLM = LlamaInferenceConfig, NeuronLlamaForCausalLM

    def load_pretrained_config(path: str) -> Any:
        def load(config: Any) -> None:  # what the library's loader does: config.json onto the config
            config.loaded_from = ("hf", path)
            config.__dict__.update({k: v for k, v in CONFIG.items() if k != "head_dim"}, head_dim=None)

        return load

    modules["neuronx_distributed_inference.utils.hf_adapter"].load_pretrained_config = load_pretrained_config
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return Recorder


def build_plan(tmp_path: Path, compiler_version: str = "2.21.0", **options: Any) -> NxdiBuildPlan:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    cli = {
        "model_id": str(folder),
        "tensor_parallel_degree": 2,
        "n_positions": 256,
        "dtype": "bf16",
        **options,
    }
    request = BuildRequest(load_config(cli, env={}), {}, NXDI_BACKEND.name, 2)
    return NXDI_BACKEND.plan(request, folder, CompileOptions(compiler_version=compiler_version))


@pytest.fixture()
def built(tmp_path: Path) -> NxdiBuildPlan:
    return build_plan(tmp_path)


@pytest.fixture()
def plan(built: NxdiBuildPlan) -> Any:
    return built.mapped


def test_a_miss_compiles_once_and_serves_that_model(
    library: type[Recorder], built: NxdiBuildPlan, plan: Any, tmp_path: Path
) -> None:
    cache = CompileCache(tmp_path / "cache")
    app = load_runner(NXDI_BACKEND, built, cache).model
    assert len(library.built) == 1 and app is library.built[0]  # built once, never twice
    assert len(library.compiled) == 1
    entry = cache.lookup(nxdi_key_inputs(plan, CONFIG, compiler_version="2.21.0"))
    assert entry is not None and library.loaded == [str(entry.path)]
    assert app.config.neuron_config.kwargs["torch_dtype"] is torch.bfloat16
    sampling = app.config.neuron_config.kwargs["on_device_sampling_config"]  # on by default, as AWS tunes it
    assert isinstance(sampling, OnDeviceSamplingConfig) and sampling.kwargs == plan.neuron_config[
        "on_device_sampling_config"]  # fmt: skip
    loaded = types.SimpleNamespace()
    app.config.loaded_from(loaded)  # the library's loader, then head_dim derived where it is None
    assert loaded.loaded_from == ("hf", plan.model_path)
    assert loaded.head_dim == CONFIG["hidden_size"] // CONFIG["num_attention_heads"]

    again = load_runner(NXDI_BACKEND, built, cache).model  # a hit: no compile
    assert len(library.compiled) == 1 and again is library.built[1]


def test_key_covers_every_neuron_config_argument(plan: Any) -> None:
    base = nxdi_key_inputs(plan, CONFIG, "2.21.0", "0.9.0")
    changed = type(plan)(**{**{f: getattr(plan, f) for f in plan.__slots__}, "neuron_config": {
        **plan.neuron_config, "fused_qkv": not plan.neuron_config["fused_qkv"]}})  # fmt: skip
    assert nxdi_key_inputs(changed, CONFIG, "2.21.0", "0.9.0").key() != base.key()
    assert nxdi_key_inputs(plan, CONFIG, "2.21.0", "0.9.1").key() != base.key()
    assert nxdi_key_inputs(plan, CONFIG, "2.22.0", "0.9.0").key() != base.key()
    assert base.describe()["library_args"]["neuron_config"]["tp_degree"] == 2


def test_no_compile_refuses_a_miss(library: type[Recorder], built: NxdiBuildPlan, tmp_path: Path) -> None:
    from compile_cache import CacheMissError

    with pytest.raises(CacheMissError):
        load_runner(NXDI_BACKEND, built, CompileCache(tmp_path / "c"), no_compile=True)
    assert library.built == []


def test_given_artifact_directory_loads_in_place(library: type[Recorder], tmp_path: Path) -> None:
    given = tmp_path / "artifacts"
    given.mkdir()
    (given / "neuron_config.json").write_text("{}")
    (given / "model.pt").write_bytes(b"x")
    built = build_plan(tmp_path, compiled_graph_path=str(given))
    assert built.units == ()  # nothing to compile: no store is opened
    load_runner(NXDI_BACKEND, built, None)
    assert library.loaded == [str(given)] and library.compiled == []


def test_without_the_sdk_the_error_names_the_packages(built: NxdiBuildPlan, tmp_path: Path) -> None:
    with pytest.raises(
        RuntimeError, match=r"neuronx-distributed-inference.*pip\.repos\.neuron\.amazonaws\.com"
    ):
        load_runner(NXDI_BACKEND, built, CompileCache(tmp_path / "c"))
