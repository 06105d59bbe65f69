"""The NxD Inference runner against NxD Inference's continuous-batching forward contract.

What runs here: ``NxdiRunner`` driving ``NxdiContractModel`` (the library's ``forward(input_ids,
attention_mask, position_ids, seq_ids)`` semantics on the CPU reference model, padding and seq_id
handling included) inside the real ``EngineCore``, for Llama, Mistral (sliding window shorter than the
sequences), Mixtral, Qwen2, Qwen3, Qwen3-MoE and Gemma 3 (text and vision-language, as NxD Inference
serves them: ``test_families.TINY``). Nothing here runs on a Neuron device.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from neuron_lmi.backends.common import eos_ids_for
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.backends.nxdi.backend import build_nxdi_runner
from neuron_lmi.backends.nxdi.plan import ON_DEVICE_SAMPLING
from neuron_lmi.backends.nxdi.runner import NxdiRunner
from neuron_lmi.backends.registry import BuildRequest
from neuron_lmi.config import load_config
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint, load_tokenizer
from neuron_lmi.runners.base import DeviceSampling, RunnerCapabilities
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from neuron_lmi.testing.nxdi_contract import NxdiContractModel
from tests.backends.conftest import run_schedule
from tests.backends.nxdi.test_families import TINY, tiny_checkpoint

N_ROWS, N_POSITIONS = 4, 64
# (step the request joins at, prompt length, max_new_tokens): five requests share four rows, a 1-token
# prompt is a context encoding at position 0, a 20-token prompt is longer than the estimate (16).
SCHEDULE = [(0, 5, 6), (0, 20, 7), (2, 1, 5), (3, 9, 9), (3, 3, 3), (6, 12, 5)]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=list(TINY))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, N_POSITIONS)


def load(folder: Path) -> tuple[Any, Any, list[int]]:
    ckpt = load_checkpoint(folder, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    tokenizer = load_tokenizer(ckpt)
    return model, tokenizer, eos_ids_for(ckpt.config, tokenizer)


def properties(folder: Path, model_dir: Path) -> Path:
    path = folder / "serving.properties"
    path.write_text(
        f"option.model_id={model_dir}\noption.model_loader=nxdi\noption.max_rolling_batch_size={N_ROWS}\n"
        f"option.n_positions={N_POSITIONS}\noption.dtype=fp32\noption.tensor_parallel_degree=1\n"
        "option.context_length_estimate=8,16\n",
        encoding="utf-8",
    )
    return path


def windowless(model: Any) -> Any:
    """The same weights attending to the whole sequence: NxD Inference's Mixtral, which has no window."""
    return model.without_window()


@pytest.mark.parametrize("sampling", ["on-device", "host"])
def test_nxdi_runner_on_the_contract_matches_the_cpu_engine(
    checkpoint: Path, tmp_path: Path, sampling: str
) -> None:
    """On-device (the default; no log-probabilities asked, so the device's tokens are used) and host."""
    model, tokenizer, eos = load(checkpoint)
    ignores_window = model.args.moe is not None  # NxD Inference's Mixtral never reads sliding_window
    reference = windowless(model) if ignores_window else model
    expected = run_schedule(EngineCore(CpuRunner(reference, N_ROWS, N_POSITIONS), tokenizer, eos), SCHEDULE)

    device = sampling == "on-device"
    contract = NxdiContractModel(
        model,
        N_ROWS,
        N_POSITIONS,
        context_length_estimate=(8, 16),
        ignores_sliding_window=ignores_window,
        on_device_sampling=dict(ON_DEVICE_SAMPLING) if device else None,
        output_logits=device,
    )
    props = properties(tmp_path, checkpoint)
    if not device:
        props.write_text(props.read_text() + "option.on_device_sampling=false\n", encoding="utf-8")
    resolved = load_config(properties_path=props, env={})
    runner = build_nxdi_runner(BuildRequest(resolved, {}, "neuron-nxdi", 1), checkpoint, model=contract)
    assert (runner.capabilities.device_sampling is not None) is device
    got = run_schedule(EngineCore(runner, tokenizer, eos), SCHEDULE, logprobs=not device)

    assert got == expected
    # every call carried greedy sampling_params (top_k 1) on the device, none on the host
    assert bool(contract.sampling_params) is device
    assert all(bool((p[:, 0] == 1).all()) for p in contract.sampling_params)
    assert all(len(got[f"r{i}"]) == new for i, (_, _, new) in enumerate(SCHEDULE))
    assert {kind for kind, _ in contract.calls} == {"context", "token"}
    # One prompt per context call (ctx_batch_size=1), whole prompts: no token-by-token prefill; a
    # prompt under three tokens comes padded to the largest bucket (n_positions) by the runner.
    contexts = [shape for kind, shape in contract.calls if kind == "context"]
    sent = [length if length >= 3 else N_POSITIONS for _, length, _ in SCHEDULE]
    assert sorted(t for _, t in contexts) == sorted(sent)
    assert all(n == 1 for n, _ in contexts)
    assert runner.rows.in_use() == []


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model, _, _ = load(make_tiny_checkpoint(tmp_path_factory.mktemp("llama-unit"), arch="llama"))
    return model


def test_full_batch_out_of_seq_id_order_corrupts_the_contract(llama: Any) -> None:
    """The contract models the library's trap: a full batch runs unchanged, line i -> cache row i."""
    contract = NxdiContractModel(llama, 2, N_POSITIONS)
    for row, prompt in ((0, [5, 6, 7]), (1, [9, 10])):
        contract(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            position_ids=torch.arange(len(prompt))[None],
            seq_ids=torch.tensor([row]),
        )
    ordered = NxdiRunner(NxdiContractModel(llama, 2, N_POSITIONS), 2, N_POSITIONS, llama.args.vocab_size)
    cpu = CpuRunner(llama, 2, N_POSITIONS)
    for runner in (ordered, cpu):
        a, b = runner.rows.allocate(), runner.rows.allocate()
        runner.prefill([a, b], [[5, 6, 7], [9, 10]])
    want = cpu.decode([1, 0], [11, 12])
    got = ordered.decode([1, 0], [11, 12])  # asked out of order: the runner sorts
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    unsorted = contract(
        input_ids=torch.tensor([[11], [12]]),
        attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]),
        position_ids=torch.tensor([[2], [3]]),
        seq_ids=torch.tensor([1, 0]),
    )
    assert not torch.allclose(unsorted.logits[:, 0], want, atol=1e-3)


def test_a_live_row_not_stepping_keeps_its_cache(llama: Any) -> None:
    """Padding repeats the first line; a longer live row would lose a filled position without riding along."""
    cpu = CpuRunner(llama, 3, N_POSITIONS)
    nxdi = NxdiRunner(NxdiContractModel(llama, 3, N_POSITIONS), 3, N_POSITIONS, llama.args.vocab_size)
    results = []
    for runner in (cpu, nxdi):
        a, b = runner.rows.allocate(), runner.rows.allocate()
        runner.prefill([a, b], [[3, 4], [7, 8, 9, 10, 11, 12]])
        runner.decode([a], [5])  # b does not step: position 2 of b is filled and must survive
        results.append(runner.decode([a, b], [6, 13]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-4)


def test_on_device_sampling_tokens_become_one_hot_logits(llama: Any) -> None:
    class TokensOnly:
        def __call__(self, **kwargs: torch.Tensor) -> Any:
            n = kwargs["input_ids"].shape[0]
            return type("Out", (), {"logits": None, "tokens": torch.arange(n, dtype=torch.int32) + 40})()

    runner = NxdiRunner(TokensOnly(), 2, N_POSITIONS, llama.args.vocab_size, DeviceSampling(logits=False))
    row = runner.rows.allocate()
    logits = runner.prefill([row], [[1, 2, 3]])
    assert int(logits.argmax(-1)[0]) == 40
    assert torch.isinf(logits).sum() == llama.args.vocab_size - 1


def test_wrong_logits_shape_is_an_error(llama: Any) -> None:
    runner = NxdiRunner(lambda **_: torch.zeros(2, 5), 2, N_POSITIONS, llama.args.vocab_size)
    row = runner.rows.allocate()
    with pytest.raises(RuntimeError, match="expected"):
        runner.prefill([row], [[1, 2]])


def test_riding_rows_would_corrupt_a_ring_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The contract keeps NxD Inference's sliding-window ring: with prompts prefilled before the
    step's decodes (so fresh rows ride along at their next position) a Mistral with a window of 8
    loses keys and diverges from the CPU engine; the runner's needs order the step so none rides."""
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("ring"), arch="mistral", sliding_window=8)
    model, tokenizer, eos = load(folder)
    expected = run_schedule(EngineCore(CpuRunner(model, N_ROWS, N_POSITIONS), tokenizer, eos), SCHEDULE)
    outputs = {}
    for capabilities in (NxdiRunner.capabilities, RunnerCapabilities()):
        contract = NxdiContractModel(model, N_ROWS, N_POSITIONS, context_length_estimate=(8, 16))
        runner = NxdiRunner(contract, N_ROWS, N_POSITIONS, model.args.vocab_size, sliding_window=8)
        runner.capabilities = capabilities  # type: ignore[misc]
        outputs[capabilities] = run_schedule(EngineCore(runner, tokenizer, eos), SCHEDULE)
    assert outputs[NxdiRunner.capabilities] == expected
    assert outputs[RunnerCapabilities()] != expected


def test_a_one_token_prompt_is_sent_padded_by_the_runner(llama: Any) -> None:
    """The library returns a padding slot's logits for a bare one-token prompt; the runner's own
    padding (positions 0) makes it the token's."""
    cpu = CpuRunner(llama, 2, N_POSITIONS)
    cpu_row = cpu.rows.allocate()
    want = cpu.prefill([cpu_row], [[77]])
    bare = NxdiContractModel(llama, 2, N_POSITIONS)(
        input_ids=torch.tensor([[77]]),
        attention_mask=torch.ones(1, 1, dtype=torch.long),
        position_ids=torch.zeros(1, 1, dtype=torch.long),
        seq_ids=torch.tensor([0]),
    ).logits[:, 0]
    assert not torch.allclose(bare, want, atol=1e-3)
    runner = NxdiRunner(NxdiContractModel(llama, 2, N_POSITIONS), 2, N_POSITIONS, llama.args.vocab_size)
    row = runner.rows.allocate()
    torch.testing.assert_close(runner.prefill([row], [[77]]), want, rtol=1e-4, atol=1e-4)


def test_the_contract_mixtral_has_no_window(tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("mixtral-window"), arch="mixtral", sliding_window=4)
    model, _, _ = load(folder)
    prompt = torch.arange(3, 15)[None]
    contract = NxdiContractModel(model, 1, N_POSITIONS, ignores_sliding_window=True)
    call = {
        "input_ids": prompt,
        "attention_mask": torch.ones_like(prompt),
        "position_ids": torch.arange(12)[None],
    }
    got = contract(**call, seq_ids=torch.tensor([0])).logits[:, 0]
    windowed, _, _ = model.prefill(prompt, [12])
    plain, _, _ = windowless(model).prefill(prompt, [12])
    torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, windowed, atol=1e-3)
