"""Chunked prefill and prefix reuse on the real CPU runner: token-exact greedy parity either way."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.scheduler import ChunkedPrefill, WholePrompts
from neuron_lmi.engine.types import FinishReason, SamplingParams
from neuron_lmi.runners.base import ForwardByKind

from .conftest import hf_greedy, random_prompts

GREEDY = SamplingParams(max_new_tokens=24)


class Spy(ForwardByKind):
    """The runner, counting the calls the engine makes on it."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, Counter()

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name in ("prefill", "extend", "copy", "decode"):

            def counted(*args, **kwargs):
                self.calls[name] += 1
                return attr(*args, **kwargs)

            return counted
        return attr


def core_on(llm: LLM, runner=None, **kwargs) -> EngineCore:
    return EngineCore(runner or llm.core.runner, llm.core.tokenizer, llm.core.eos_token_ids, **kwargs)


def assert_same(expected, got) -> None:
    for a, b in zip(expected, got, strict=True):
        assert b.token_ids == a.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def reference(llm: LLM, prompts, params=GREEDY):
    """Whole-prompt prefill without reuse: what the engine did before chunks."""
    core = core_on(llm, prefill=WholePrompts(4096), prefix_reuse=False)
    return LLM.from_core(core).generate(prompts, params)


@pytest.mark.parametrize("step_tokens", [33, 96])
def test_chunked_prefill_is_token_exact_with_whole_prompt_prefill(tiny_llm: LLM, step_tokens: int) -> None:
    prompts = random_prompts([5, 40, 130, 200, 17], seed=31)
    expected = reference(tiny_llm, prompts)
    spy = Spy(tiny_llm.core.runner)
    chunked = core_on(tiny_llm, spy, prefill=ChunkedPrefill(step_tokens, 16), prefix_reuse=False)
    assert_same(expected, LLM.from_core(chunked).generate(prompts, GREEDY))
    assert spy.calls["extend"] > 0
    assert tiny_llm.core.runner.rows.occupancy().rows_used == 0


def test_chunked_prefill_respects_the_sliding_window(tiny_mistral_dir: Path) -> None:
    llm = LLM(
        str(tiny_mistral_dir), dtype="fp32", enforce_eager=True, max_rolling_batch_size=4, n_positions=256
    )
    window = llm.core.runner.model.args.sliding_window
    prompts = random_prompts([3 * window + 5, window - 3], seed=32)
    expected = reference(llm, prompts)
    chunked = core_on(llm, prefill=ChunkedPrefill(window + 3, 8), prefix_reuse=False)
    assert_same(expected, LLM.from_core(chunked).generate(prompts, GREEDY))


def test_a_prompt_longer_than_the_largest_bucket_is_prefilled_in_chunks(tiny_llm: LLM, hf_tiny_llama) -> None:
    runner = CpuRunner(tiny_llm.core.runner.model, 2, 256, context_buckets=[16, 32])
    assert runner.context_buckets[-1] == 32
    prompt = random_prompts([100], seed=33)[0]
    ref_ids, ref_logprobs = hf_greedy(hf_tiny_llama, prompt, GREEDY.max_new_tokens)
    assert runner.capabilities.max_chunk_tokens == 32  # the scheduler cuts the prompt, whatever the policy
    for prefill in (WholePrompts(4096), ChunkedPrefill(64, 16)):
        core = core_on(tiny_llm, runner, prefill=prefill, prefix_reuse=False)
        (result,) = LLM.from_core(core).generate([prompt], GREEDY)
        assert result.token_ids == ref_ids
        assert max(abs(a - b) for a, b in zip(result.logprobs, ref_logprobs, strict=True)) < 1e-3
    assert runner.rows.occupancy().rows_used == 0


def test_prefix_reuse_is_token_exact_and_copies_or_claims_rows(tiny_llm: LLM) -> None:
    system = random_prompts([120], seed=34)[0]
    tails = random_prompts([3, 11, 30, 1], seed=35)
    prompts = [system + tail for tail in tails]
    expected = reference(tiny_llm, prompts)
    spy = Spy(tiny_llm.core.runner)
    llm = LLM.from_core(core_on(tiny_llm, spy))
    # One after another: each claims the row the previous one left (no copy).
    got = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert_same(expected, got)
    assert spy.calls["prefill"] == 1 and spy.calls["copy"] == 0 and spy.calls["extend"] == 3
    # Joining while a sharer runs: its prefix is copied from the running row.
    core = llm.core
    first = core.make_request(prompts[0], GREEDY)
    core.add(first)
    core.step()
    results = llm.generate(prompts[1:], GREEDY)
    while core.has_work():
        core.step()
    assert_same(expected[1:], results)
    assert spy.calls["copy"] >= 1
    assert tiny_llm.core.runner.rows.occupancy().rows_used == 0


def test_a_failed_request_leaves_no_row_and_nothing_to_reuse(tiny_llm: LLM) -> None:
    class FailingDecode(Spy):
        def decode(self, rows, tokens):
            raise RuntimeError("injected decode failure")

    runner = tiny_llm.core.runner
    prompt = random_prompts([60], seed=36)[0]
    core = core_on(tiny_llm, FailingDecode(runner))
    (failed,) = LLM.from_core(core).generate([prompt], SamplingParams(max_new_tokens=3))
    assert failed.finish_reason is FinishReason.ERROR and len(failed.token_ids) == 1
    assert runner.rows.occupancy().rows_used == 0
    assert core.scheduler.prefix.match([*prompt, 5], [], ()) is None
