"""Continuous batching on the real engine: batch invariance and KV-row accounting."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.detokenizer import TextSink, TokenTexts, text_stream
from neuron_lmi.engine.types import FinishReason, InvalidRequestError, SamplingParams, TokenEvent
from neuron_lmi.runners.base import ForwardByKind, RunnerCapabilities

from .conftest import random_prompts

STOPPED: list[tuple[EngineCore, str]] = []  # ended by a stop sequence in the front, to abort


def run_until_done(core: EngineCore) -> None:
    while core.has_work():
        core.step()
        while STOPPED:
            owner, request_id = STOPPED.pop()
            owner.abort(request_id)


def collect(core: EngineCore, prompt, params: SamplingParams) -> list[TokenEvent]:
    """Events as a front delivers them: with text, and stop sequences matched (``TextSink``)."""
    events: list[TokenEvent] = []
    request = core.make_request(prompt, params)
    text = text_stream(core.tokenizer, request.prompt_ids, params)
    stop = lambda: STOPPED.append((core, request.request_id))  # noqa: E731
    request.sink = TextSink(text, TokenTexts(core.tokenizer), events.append, stop)
    core.add(request)
    return events


def test_output_is_the_same_alone_and_with_15_requests_joining_and_leaving(tiny_llm: LLM) -> None:
    core = tiny_llm.core
    target_prompt = random_prompts([23], seed=11)[0]
    params = SamplingParams(max_new_tokens=48)
    alone = tiny_llm.generate([target_prompt], params)[0].token_ids

    others = random_prompts([3 + 7 * i for i in range(15)], seed=12)
    target = collect(core, target_prompt, params)
    joined = 0
    while core.has_work():
        # Others join one or two per step, with different lengths, and leave at different times.
        for _ in range(2 if joined % 3 else 1):
            if joined < len(others):
                collect(core, others[joined], SamplingParams(max_new_tokens=5 + 4 * joined))
                joined += 1
        core.step()
    assert joined == 15
    assert [e.token_id for e in target] == alone
    assert core.runner.rows.occupancy().rows_used == 0


class FailingRunner(ForwardByKind):
    """The real runner, failing any prefill that contains ``poison`` (to exercise error handling)."""

    def __init__(self, inner, poison: int) -> None:
        self.inner, self.poison = inner, poison
        self.rows, self.vocab_size, self.n_positions = inner.rows, inner.vocab_size, inner.n_positions
        self.capabilities = RunnerCapabilities()  # whole prompts, so every prefill meets the poison

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        if any(self.poison in p for p in prompts):
            raise RuntimeError("injected failure")
        return self.inner.prefill(rows, prompts)

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        return self.inner.decode(rows, tokens)


def test_no_row_leaks_after_completed_stopped_aborted_and_failed_requests(tiny_llm: LLM) -> None:
    base = tiny_llm.core
    poison = 4242
    core = EngineCore(FailingRunner(base.runner, poison), base.tokenizer, base.eos_token_ids)
    prompts = random_prompts([10, 12, 14, 16, 18], seed=5)
    completed = collect(core, prompts[0], SamplingParams(max_new_tokens=6))
    # A stop string taken from what this prompt greedily produces, so it really matches.
    stop_text = tiny_llm.generate([prompts[1]], SamplingParams(max_new_tokens=8))[0].text[3:8]
    stopped = collect(core, prompts[1], SamplingParams(max_new_tokens=30, stop=(stop_text,)))
    aborted_request = core.make_request(prompts[2], SamplingParams(max_new_tokens=30))
    core.add(aborted_request)
    failed = collect(core, [poison, *prompts[3]], SamplingParams(max_new_tokens=30))
    with pytest.raises(InvalidRequestError):
        core.make_request(prompts[4], SamplingParams(max_new_tokens=core.runner.n_positions))
    core.step()
    assert failed[-1].finish_reason is FinishReason.ERROR  # failed alone, in the first step
    assert len(completed) == 1 and core.runner.rows.occupancy().rows_used == len(core.requests) == 3
    assert core.abort(aborted_request.request_id)
    run_until_done(core)
    assert completed[-1].finish_reason is FinishReason.LENGTH and len(completed) == 6
    assert stopped[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert stop_text not in "".join(e.text for e in stopped)
    assert failed[-1].finish_reason is FinishReason.ERROR and "injected failure" in failed[-1].error
    assert core.runner.rows.occupancy().rows_used == 0
    assert not core.requests


def test_eos_finishes_with_eos_token_and_is_not_in_the_text(tiny_llm: LLM) -> None:
    core = tiny_llm.core
    prompt = random_prompts([9], seed=21)[0]
    first = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=1))[0].token_ids[0]
    saved = core.eos_token_ids
    core.eos_token_ids = frozenset({first})  # make the model's first greedy token the EOS
    try:
        result = tiny_llm.generate([prompt], SamplingParams(max_new_tokens=10))[0]
    finally:
        core.eos_token_ids = saved
    assert result.finish_reason is FinishReason.EOS_TOKEN
    assert result.token_ids == [first] and result.text == ""


def test_prompt_plus_max_new_tokens_beyond_n_positions_is_refused(tiny_llm: LLM) -> None:
    core = tiny_llm.core
    too_long = [5] * (core.runner.n_positions - 3)
    with pytest.raises(InvalidRequestError, match="exceeds n_positions") as info:
        core.make_request(too_long, SamplingParams(max_new_tokens=8))
    assert info.value.field == "inputs"
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        core.make_request([core.runner.vocab_size + 1], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        core.make_request("", SamplingParams())
    assert core.runner.rows.occupancy().rows_used == 0


def test_seeded_sampling_reproduces_and_differs_across_seeds(tiny_llm: LLM) -> None:
    prompt = random_prompts([12], seed=8)[0]

    def run(seed: int) -> list[int]:
        params = SamplingParams(max_new_tokens=16, temperature=1.5, top_p=0.95, top_k=50, seed=seed)
        return tiny_llm.generate([prompt], params)[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)
