"""Shared by the Neuron runner tests: one torch thread, and a schedule of requests joining a real
``EngineCore`` step by step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.types import SamplingParams


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend on a loaded box
    yield
    torch.set_num_threads(before)


def run_schedule(
    core: EngineCore, schedule: Sequence[tuple[int, int, int]], logprobs: bool = True
) -> dict[str, list[int]]:
    """Run ``core`` until idle, adding request ``r{i}`` at step ``at`` with a random prompt of
    ``length`` tokens (seeded) and ``new`` greedy tokens (EOS ignored); returns each one's output ids."""
    generator = torch.Generator().manual_seed(0)
    outputs: dict[str, list[int]] = {}
    step = 0
    while step == 0 or core.has_work() or any(at >= step for at, _, _ in schedule):
        for i, (at, length, new) in enumerate(schedule):
            if at == step:
                prompt = torch.randint(3, 49000, (length,), generator=generator).tolist()
                request = core.make_request(
                    prompt,
                    SamplingParams(max_new_tokens=new, ignore_eos=True, logprobs=logprobs),
                    request_id=f"r{i}",
                )
                outputs[request.request_id] = request.output_ids
                core.add(request)
        core.step()
        step += 1
    return outputs
