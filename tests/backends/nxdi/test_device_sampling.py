"""On-device sampling on the NxD Inference runner, driven against the contract model (what
``tests/backends/nxdi_library/test_device_sampling.py`` checks on the library's own code): per-row
sampling_params reach the device, greedy rows stay exact beside sampled rows, rows the device cannot
sample for are sampled on the host from the logits, and without logits they are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.backends.nxdi.plan import ON_DEVICE_SAMPLING
from neuron_lmi.backends.nxdi.runner import NxdiRunner
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.device_sampling import host_field, line_sampling
from neuron_lmi.engine.types import InvalidRequestError, SamplingParams
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint, load_tokenizer
from neuron_lmi.runners.base import GREEDY_LINE, BatchKind, DeviceSampling, LineSampling, StepBatch
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from neuron_lmi.testing.nxdi_contract import NxdiContractModel

ROWS, N_POSITIONS = 3, 64
DEVICE = DeviceSampling(per_line=True, max_top_k=256, logits=True)
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=False)
HOT = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=False, temperature=50.0, top_k=200)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    ckpt = load_checkpoint(make_tiny_checkpoint(tmp_path_factory.mktemp("ods"), arch="llama"), torch.float32)
    return build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS), load_tokenizer(ckpt)


def nxdi(model: Any, logits: bool = True, **config: Any) -> tuple[NxdiRunner, NxdiContractModel]:
    sampling = {**ON_DEVICE_SAMPLING, **config}
    contract = NxdiContractModel(model, ROWS, N_POSITIONS, on_device_sampling=sampling, output_logits=logits)
    per_line = bool(sampling.get("dynamic") or sampling.get("do_sample"))
    device = DeviceSampling(per_line, int(sampling["global_topk"]) if per_line else 1, logits)
    return NxdiRunner(contract, ROWS, N_POSITIONS, model.args.vocab_size, device), contract


def generate(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    requests = [
        core.make_request(p, sp, request_id=str(i))
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    for request in requests:
        core.add(request)
    while core.has_work():
        core.step()
    return [r.output_ids for r in requests]


PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def test_greedy_rows_stay_exact_beside_sampled_rows(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    expected = generate(EngineCore(CpuRunner(model, ROWS, N_POSITIONS), tokenizer, []), PROMPTS, [GREEDY] * 3)
    runner, contract = nxdi(model)
    got = generate(EngineCore(runner, tokenizer, []), PROMPTS, [GREEDY, HOT, GREEDY])
    assert got[0] == expected[0] and got[2] == expected[2]
    assert got[1] != expected[1]  # temperature 50 over 200 tokens: six greedy tokens by chance is ~0
    # each row's own (top_k, top_p, temperature) reached the device, in seq_id order
    decode = [p for p in contract.sampling_params if len(p) == ROWS]
    assert decode and torch.equal(decode[0], torch.tensor([[1, 1.0, 1.0], [200, 1.0, 50.0], [1, 1.0, 1.0]]))


def test_a_sampled_row_is_a_distribution_not_a_point(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    runner, _ = nxdi(model)
    row = runner.rows.allocate()
    prefill = StepBatch(BatchKind.PREFILL, (row,), (0,), ([5, 6, 7],), (True,))
    greedy = {int(runner.forward_sampled(prefill, [GREEDY_LINE]).tokens[0]) for _ in range(8)}
    drawn = {int(runner.forward_sampled(prefill, [LineSampling(200, 1.0, 50.0)]).tokens[0]) for _ in range(8)}
    assert len(greedy) == 1 and len(drawn) > 1


def test_rows_needing_the_host_are_sampled_from_the_logits(tiny: tuple[Any, Any]) -> None:
    """logprobs, a seed and a penalty go to the host; their results are the CPU engine's."""
    model, tokenizer = tiny
    host = [
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=False, temperature=0.8, seed=7),
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=False, repetition_penalty=1.3),
    ]
    cpu = EngineCore(CpuRunner(model, ROWS, N_POSITIONS), tokenizer, [])
    expected = generate(cpu, PROMPTS, host)
    runner, _ = nxdi(model)
    core = EngineCore(runner, tokenizer, [])
    assert generate(core, PROMPTS, host) == expected


def test_without_logits_a_request_needing_the_host_is_refused(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    core = EngineCore(nxdi(model, logits=False)[0], tokenizer, [])
    for params, field in [
        (SamplingParams(max_new_tokens=4, logprobs=True), "logprobs"),
        (SamplingParams(max_new_tokens=4, logprobs=False, temperature=0.7, seed=3), "seed"),
        (SamplingParams(max_new_tokens=4, logprobs=False, logit_bias=((5, 2.0),)), "logit_bias"),
        (SamplingParams(max_new_tokens=4, logprobs=False, temperature=0.7, min_p=0.1), "min_p"),
        (SamplingParams(max_new_tokens=4, logprobs=False, temperature=0.7, top_k=300), "top_k"),
    ]:
        with pytest.raises(InvalidRequestError, match=field) as caught:
            core.make_request([5, 6], params)
        assert caught.value.field == field
    assert core.make_request([5, 6], HOT).params.temperature == 50.0


def test_a_greedy_only_sampler_never_turns_a_sampled_request_greedy(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    runner, _ = nxdi(model, logits=False, dynamic=False, do_sample=False)
    core = EngineCore(runner, tokenizer, [])
    with pytest.raises(InvalidRequestError, match="temperature"):
        core.make_request([5, 6], HOT)
    assert core.make_request([5, 6], GREEDY).params.greedy


def test_the_lines_the_device_is_given() -> None:
    assert line_sampling(GREEDY, DEVICE) == GREEDY_LINE  # top_k 1 at temperature 1: never / 0
    assert line_sampling(SamplingParams(temperature=0.5), DEVICE) == LineSampling(256, 1.0, 0.5)
    assert line_sampling(SamplingParams(temperature=0.5, top_k=40, top_p=0.9), DEVICE) == LineSampling(
        40, 0.9, 0.5
    )
    assert host_field(SamplingParams(), DEVICE) == "logprobs"  # the engine's default asks for them
    assert host_field(SamplingParams(max_new_tokens=4, logprobs=False, min_tokens=2), DEVICE) == "min_tokens"
    assert (
        host_field(SamplingParams(max_new_tokens=4, logprobs=False, temperature=1.0, top_k=256), DEVICE)
        is None
    )


def test_the_contract_refuses_what_the_library_refuses(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    _, contract = nxdi(model)
    ids, positions = torch.tensor([[5, 6, 7]]), torch.arange(3)[None]
    for bad in ([[300, 1.0, 1.0]], [[1, 0.0, 1.0]], [[0, 1.0, 0.0]], [[1.5, 1.0, 1.0]]):
        with pytest.raises(ValueError, match=r"top-k|top-p|Temperature"):
            contract(input_ids=ids, position_ids=positions, sampling_params=torch.tensor(bad))


def test_a_partial_decode_goes_to_the_library_as_a_full_batch(tiny: tuple[Any, Any]) -> None:
    """As the library completes it on a device (its CPU mode fails on a partial batch with logits)."""
    model, _ = tiny
    runner, contract = nxdi(model)
    cpu = CpuRunner(model, ROWS, N_POSITIONS)
    for r in (runner, cpu):
        a, b = r.rows.allocate(), r.rows.allocate()
        r.prefill([a, b], [[5, 6, 7], [8, 9, 10]])
    got, want = runner.decode([b, a], [12, 11]), cpu.decode([b, a], [12, 11])
    assert contract.calls[-1] == ("token", (ROWS, 1))
    assert torch.equal(contract.sampling_params[-1][:, 0], torch.ones(ROWS))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
