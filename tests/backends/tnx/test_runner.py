"""The Neuron runner against transformers-neuronx's continuous-batching contract, and its start-up wiring.

What runs here: ``NeuronRunner`` driving ``ContractModel`` (the library's ``forward(input_ids,
cache_ids, start_ids)`` contract on the CPU reference model) inside the real ``EngineCore``; the
construction of ``from_pretrained`` arguments and ``NeuronConfig`` from serving.properties, and the
compile-cache round trip, against stand-in library classes.  Nothing here runs on a Neuron device.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from compile_cache import CompileCache
from neuron_lmi.backends.common import eos_ids_for
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.backends.registry import BuildRequest
from neuron_lmi.backends.tnx.args import compile_spec_from_config
from neuron_lmi.backends.tnx.backend import build_neuron_runner
from neuron_lmi.backends.tnx.runner import NeuronRunner
from neuron_lmi.config import load_config
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint, load_tokenizer
from neuron_lmi.parallel.tp_model import apply_tensor_parallel
from neuron_lmi.testing.tnx_contract import ContractModel
from tests.backends.conftest import run_schedule

N_ROWS, N_POSITIONS = 4, 64

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> tuple[Any, Any, Any]:
    ckpt = load_checkpoint(tiny_llama_dir, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    return model, load_tokenizer(ckpt), ckpt.config


def write_properties(folder: Path, model_dir: Path, **extra: str) -> Path:
    lines = {
        "option.model_id": str(model_dir),
        "option.rolling_batch": "tnx",
        "option.max_rolling_batch_size": str(N_ROWS),
        "option.n_positions": str(N_POSITIONS),
        "option.dtype": "fp32",
        "option.tensor_parallel_degree": "1",
        "option.context_length_estimate": "8,16",
        **{f"option.{k}": v for k, v in extra.items()},
    }
    path = folder / "serving.properties"
    path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()), encoding="utf-8")
    return path


# -- greedy parity through the engine ----------------------------------------------------------

# (step the requests join at, prompt length, max_new_tokens): a 20-token prompt is longer than the
# largest context bucket (16), a 1-token prompt is a decode at position 0, five requests share 4 rows.
SCHEDULE = [(0, 5, 6), (0, 20, 4), (2, 1, 5), (3, 9, 8), (3, 3, 3)]


@pytest.mark.parametrize("tp", [1, 2])
def test_neuron_runner_on_the_contract_matches_the_cpu_engine(tiny, tiny_llama_dir, tmp_path, tp) -> None:
    model, tokenizer, config = tiny
    eos = eos_ids_for(config, tokenizer)
    expected = run_schedule(EngineCore(CpuRunner(model, N_ROWS, N_POSITIONS), tokenizer, eos), SCHEDULE)

    device_model = apply_tensor_parallel(model, tp, batch_size=N_ROWS) if tp > 1 else model
    contract = ContractModel(device_model, N_ROWS, N_POSITIONS, context_length_estimate=(8, 16))
    resolved = load_config(properties_path=write_properties(tmp_path, tiny_llama_dir))
    runner = build_neuron_runner(BuildRequest(resolved, {}, "neuron-tnx", 1), tiny_llama_dir, model=contract)
    got = run_schedule(EngineCore(runner, tokenizer, eos), SCHEDULE)

    assert got == expected
    assert all(len(got[f"r{i}"]) == new for i, (_, _, new) in enumerate(SCHEDULE))
    kinds = {kind for kind, _ in contract.calls}
    assert kinds == {"context", "token"}


def test_decode_leaves_rows_it_does_not_step_intact(tiny) -> None:
    """The device writes every row on a decode; a row prefilled this step must not lose position 0."""
    model, _, _ = tiny
    cpu, neuron = (
        CpuRunner(model, N_ROWS, N_POSITIONS),
        NeuronRunner(
            ContractModel(model, N_ROWS, N_POSITIONS), N_ROWS, N_POSITIONS, model.args.vocab_size, (32,)
        ),
    )
    results = []
    for runner in (cpu, neuron):
        a, b = runner.rows.allocate(), runner.rows.allocate()
        runner.prefill([a], [[7, 8, 9]])
        runner.prefill([b], [[10, 11, 12, 13]])
        runner.decode([a], [5])  # b is in use but does not step
        results.append(runner.decode([a, b], [6, 7]))
    torch.testing.assert_close(results[1], results[0], atol=1e-4, rtol=0)


def test_contract_rejects_what_the_library_cannot_do(tiny) -> None:
    model, _, _ = tiny
    contract = ContractModel(model, N_ROWS, N_POSITIONS, context_length_estimate=(8,))
    ids = torch.tensor([[5, 6, 7, 0]])
    with pytest.raises(ValueError, match="right-padded"):  # left padding
        contract.forward(torch.tensor([[0, 5, 6, 7]]), torch.tensor([[0, 0, 1, 2]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="2-D"):
        contract.forward(ids, torch.arange(4), torch.tensor([0]))
    with pytest.raises(ValueError, match="distinct rows"):
        contract.forward(torch.tensor([[1], [2]]), torch.tensor([[3], [3]]), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="largest context bucket"):
        contract.forward(torch.ones(1, 9, dtype=torch.long), torch.arange(9)[None], torch.tensor([0]))
    logits = contract.forward(ids, torch.tensor([[0, 1, 2, 0]]), torch.tensor([2]))
    assert logits.shape == (1, model.args.vocab_size) and logits.dtype == torch.float32


# -- start-up: arguments, NeuronConfig, compile cache ------------------------------------------


class Recorder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


class FakeSampling:
    """Stands in for ``LlamaForSampling``: records ``from_pretrained`` and the artifact calls."""

    created: ClassVar[list[FakeSampling]] = []

    def __init__(self, path: str, kwargs: dict[str, Any]) -> None:
        self.path, self.kwargs, self.events = path, kwargs, []

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> FakeSampling:
        import os

        model = cls(path, kwargs)
        model.events.append(("env", os.environ.get("NEURON_COMPILE_CACHE_URL")))
        cls.created.append(model)
        return model

    def to_neuron(self) -> None:
        self.events.append(("to_neuron",))

    def save(self, directory: str) -> None:
        Path(directory, "0123456789abcdef0123.neff").write_bytes(b"neff")
        self.events.append(("save", directory))

    def load(self, directory: str) -> None:
        self.events.append(("load", directory))


@pytest.fixture()
def fake_library(monkeypatch: pytest.MonkeyPatch) -> type[FakeSampling]:
    top = types.ModuleType("transformers_neuronx")
    for name in ("NeuronConfig", "QuantizationConfig", "GQA"):
        setattr(top, name, type(name, (Recorder,), {}))
    config = types.ModuleType("transformers_neuronx.config")
    config.ContinuousBatchingConfig = type("ContinuousBatchingConfig", (Recorder,), {})
    llama = types.ModuleType("transformers_neuronx.llama.model")
    llama.LlamaForSampling = type("LlamaForSampling", (FakeSampling,), {"created": []})
    monkeypatch.setitem(sys.modules, "transformers_neuronx", top)
    monkeypatch.setitem(sys.modules, "transformers_neuronx.config", config)
    monkeypatch.setitem(
        sys.modules, "transformers_neuronx.llama", types.ModuleType("transformers_neuronx.llama")
    )
    monkeypatch.setitem(sys.modules, "transformers_neuronx.llama.model", llama)
    return llama.LlamaForSampling


def test_serving_properties_map_to_exact_library_arguments(tiny_llama_dir, tmp_path, fake_library) -> None:
    props = write_properties(
        tmp_path, tiny_llama_dir, tensor_parallel_degree="8", dtype="bf16", n_positions="256",
        context_length_estimate="64,128", group_query_attention="shard_over_heads",
    )  # fmt: skip
    resolved = load_config(properties_path=props, env={})
    cache = CompileCache(tmp_path / "store")
    runner = build_neuron_runner(
        BuildRequest(resolved, {}, "neuron-tnx", 1),
        tiny_llama_dir,
        compiler_version="2.15-test",
        cache_dir=str(cache.root),
    )

    # Miss: one model is built, compiled into the store's staging folder, and served as it is: the
    # entry is not loaded into a second model (that would read every weight twice).
    (compiled,) = fake_library.created
    assert compiled.path == str(tiny_llama_dir)
    kwargs = dict(compiled.kwargs)
    neuron_config = kwargs.pop("neuron_config")
    assert kwargs == {
        "batch_size": N_ROWS, "tp_degree": 8, "n_positions": 256, "amp": "bf16",
        "context_length_estimate": [64, 128],
    }  # fmt: skip
    fields = dict(neuron_config.kwargs)
    continuous = fields.pop("continuous_batching")
    gqa = fields.pop("group_query_attention", None)
    assert type(continuous).__name__ == "ContinuousBatchingConfig"
    assert continuous.kwargs == {"batch_size_for_shared_caches": N_ROWS}
    assert gqa is None or gqa.args[0] in ("shard-over-heads", "replicated-heads")
    assert fields == {"fuse_qkv": False, "padding_side": "right"}
    assert [e[0] for e in compiled.events] == ["env", "to_neuron", "save"]
    assert compiled.events[0][1] == str(cache.root / ".neuron-compile-cache")
    assert runner.model is compiled
    assert len(cache.list()) == 1
    assert (runner.rows.n_rows, runner.n_positions, runner.max_context) == (N_ROWS, 256, 128)

    # A second start-up hits the cache: nothing compiles; the NEFFs are loaded into one model.
    fake_library.created.clear()
    build_neuron_runner(
        BuildRequest(resolved, {}, "neuron-tnx", 1),
        tiny_llama_dir,
        compiler_version="2.15-test",
        cache_dir=str(cache.root),
    )
    (again,) = fake_library.created
    (entry,) = cache.list()
    assert [e[0] for e in again.events] == ["env", "load", "to_neuron"]
    assert again.events[1][1] == str(entry.path)


def test_default_context_buckets_reach_n_positions(tiny, tiny_llama_dir, tmp_path) -> None:
    """Without option.context_length_estimate a prompt up to n_positions is context-encoded in one
    call (the library's own default stops at n_positions / 2 and feeds the rest one token per call)."""
    model = tiny[0]
    props = write_properties(tmp_path, tiny_llama_dir)
    lines = [line for line in props.read_text().splitlines() if "context_length_estimate" not in line]
    props.write_text("\n".join(lines) + "\n")
    resolved = load_config(properties_path=props, env={})
    contract = ContractModel(model, N_ROWS, N_POSITIONS)
    runner = build_neuron_runner(BuildRequest(resolved, {}, "neuron-tnx", 1), tiny_llama_dir, model=contract)
    assert runner.max_context == N_POSITIONS
    row = runner.rows.allocate()
    runner.prefill([row], [list(range(3, 3 + N_POSITIONS - 8))])
    assert [kind for kind, _ in contract.calls] == ["context"]


def test_default_buckets_and_max_tp(tiny_llama_dir, tmp_path) -> None:
    props = write_properties(tmp_path, tiny_llama_dir, tensor_parallel_degree="max")
    config = load_config(properties_path=props, env={}).config
    with pytest.raises(ValueError, match="visible NeuronCores"):
        compile_spec_from_config(config, str(tiny_llama_dir))
    spec = compile_spec_from_config(config, str(tiny_llama_dir), tp_degree=2)
    assert (spec.tp_degree, spec.batch_size, spec.context_length_estimate) == (2, N_ROWS, (8, 16))


def test_without_the_sdk_start_up_names_the_packages(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)
    resolved = load_config(properties_path=write_properties(tmp_path, tiny_llama_dir), env={})
    with pytest.raises(RuntimeError) as exc:
        build_neuron_runner(
            BuildRequest(resolved, {}, "neuron-tnx", 1), tiny_llama_dir, cache_dir=str(tmp_path / "store")
        )
    for name in ("transformers-neuronx", "torch-neuronx", "neuronx-cc", "pip.repos.neuron.amazonaws.com"):
        assert name in str(exc.value)
