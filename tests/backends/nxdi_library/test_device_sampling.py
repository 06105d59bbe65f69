"""(d) On-device sampling, the default, on the library's own sampler (``modules/generation/sampling.py``
in ``on_cpu`` mode): each row's sampling_params reach it, greedy rows give the CPU engine's tokens
beside sampled rows in the same batch, a sampled row is drawn from a distribution, and rows that need
the host (log-probabilities, a seed, a penalty) are sampled from the logits ``output_logits`` returns.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.backends.nxdi.runner import on_cpu_application, runner_for
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.models import build_model
from neuron_lmi.models.loader import load_checkpoint, load_tokenizer
from neuron_lmi.runners.base import GREEDY_LINE, BatchKind, LineSampling, StepBatch
from neuron_lmi.testing.checkpoints import make_tiny_checkpoint
from tests.backends.nxdi_library.conftest import nxdi_plan

ROWS, N_POSITIONS = 3, 32
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=False)
HOT = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=False, temperature=50.0, top_k=200)
pytestmark = pytest.mark.usefixtures("one_thread", "cpu_forward")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    checkpoint = make_tiny_checkpoint(tmp_path_factory.mktemp("ods"), arch="llama")
    plan, _ = nxdi_plan(checkpoint, ROWS, N_POSITIONS)
    ckpt = load_checkpoint(checkpoint, dtype=torch.float32)
    model = build_model(ckpt.config, ckpt.state_dict, n_positions=N_POSITIONS)
    return plan, model, load_tokenizer(ckpt)


def generate(core: EngineCore, params: list[SamplingParams]) -> list[list[int]]:
    requests = [
        core.make_request(p, sp, request_id=str(i))
        for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))
    ]
    for request in requests:
        core.add(request)
    while core.has_work():
        core.step()
    return [r.output_ids for r in requests]


def test_the_plan_samples_on_the_device_by_default(setup: tuple[Any, Any, Any]) -> None:
    plan, _, _ = setup
    device = plan.device_sampling()
    assert device is not None and device.per_line and device.logits and device.max_top_k == 256


def test_greedy_rows_stay_exact_beside_a_sampled_row(setup: tuple[Any, Any, Any]) -> None:
    plan, model, tokenizer = setup
    expected = generate(EngineCore(CpuRunner(model, ROWS, N_POSITIONS), tokenizer, []), [GREEDY] * 3)
    runner = runner_for(on_cpu_application(plan), plan, model.args.vocab_size)
    sent: list[torch.Tensor] = []
    call = runner.model

    def recorded(**kwargs: Any) -> Any:
        sent.append(kwargs["sampling_params"])
        return call(**kwargs)

    runner.model = recorded
    torch.manual_seed(0)  # the library's CPU sampler draws from torch's global generator
    got = generate(EngineCore(runner, tokenizer, []), [GREEDY, HOT, GREEDY])
    assert got[0] == expected[0] and got[2] == expected[2]
    assert got[1] != expected[1]
    decodes = [p for p in sent if len(p) == ROWS]
    assert decodes and torch.equal(decodes[0], torch.tensor([[1, 1.0, 1.0], [200, 1.0, 50.0], [1, 1.0, 1.0]]))


def test_a_sampled_row_is_drawn_not_fixed(setup: tuple[Any, Any, Any]) -> None:
    plan, model, _ = setup
    runner = runner_for(on_cpu_application(plan), plan, model.args.vocab_size)
    row = runner.rows.allocate()
    prefill = StepBatch(BatchKind.PREFILL, (row,), (0,), ([5, 6, 7],), (True,))
    torch.manual_seed(0)
    greedy = {int(runner.forward_sampled(prefill, [GREEDY_LINE]).tokens[0]) for _ in range(8)}
    drawn = {int(runner.forward_sampled(prefill, [LineSampling(200, 1.0, 50.0)]).tokens[0]) for _ in range(8)}
    assert len(greedy) == 1 and len(drawn) > 1


def test_rows_needing_the_host_are_sampled_from_the_logits(setup: tuple[Any, Any, Any]) -> None:
    plan, model, tokenizer = setup
    host = [
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=False, temperature=0.8, seed=7),
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=False, repetition_penalty=1.3),
    ]
    expected = generate(EngineCore(CpuRunner(model, ROWS, N_POSITIONS), tokenizer, []), host)
    runner = runner_for(on_cpu_application(plan), plan, model.args.vocab_size)
    assert generate(EngineCore(runner, tokenizer, []), host) == expected


def test_the_cpu_mode_fails_on_a_partial_batch_with_logits(setup: tuple[Any, Any, Any]) -> None:
    """Why ``NxdiRunner`` completes a partial batch itself: the library's CPU path unpacks
    ``logits, *kv_caches`` from [tokens, logits, K/V...] and writes the logits into the cache."""
    plan, _, _ = setup
    app = on_cpu_application(plan)
    ones = torch.ones(1, 3)
    with torch.inference_mode():
        app(
            input_ids=torch.tensor([[5, 6, 7]]),
            attention_mask=torch.ones(1, 3, dtype=torch.long),
            position_ids=torch.arange(3)[None],
            seq_ids=torch.tensor([0]),
            sampling_params=ones,
        )
        with pytest.raises(IndexError):
            app(
                input_ids=torch.tensor([[8]]),
                attention_mask=torch.ones(1, 3, dtype=torch.long),
                position_ids=torch.tensor([[3]]),
                seq_ids=torch.tensor([0]),
                sampling_params=ones,
            )
