"""N-gram speculative decoding on the real CPU engine (tiny random Llama, fp32): greedy output is the
output without speculation, rows hold exactly what was accepted, ends inside an accepted run are
exact; the rejection sampler keeps the target distribution."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.config.speculative import SpeculativeConfig
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.request import Request
from neuron_lmi.engine.speculation import (
    MISSES_BEFORE_PAUSE,
    PAUSE_STEPS,
    DraftCost,
    Speculator,
    acceptance,
    propose_ngram,
    rejection_sample,
    sampling_logits,
    worth_drafting,
)
from neuron_lmi.engine.types import FinishReason, SamplingParams, TokenEvent

from .conftest import random_prompts

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


def core_on(llm: LLM, speculative: SpeculativeConfig | None = None, **kwargs) -> EngineCore:
    core = llm.core
    return EngineCore(core.runner, core.tokenizer, core.eos_token_ids, speculative=speculative, **kwargs)


def repeating(seed: int, period: int, times: int) -> list[int]:
    """A prompt that repeats a random phrase: the lookup finds drafts in it from the first step."""
    return random_prompts([period], seed=seed)[0] * times


def prompts() -> list[list[int]]:
    return [repeating(1, 7, 4), repeating(2, 3, 6), *random_prompts([5, 40, 17], seed=3), repeating(4, 11, 3)]


def generate(core: EngineCore, batch, params) -> list:
    return LLM.from_core(core).generate(batch, params)


def assert_same(expected, got) -> None:
    for a, b in zip(expected, got, strict=True):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_greedy_output_is_token_identical_with_ngram_speculation(tiny_llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=32)
    expected = generate(core_on(tiny_llm), prompts(), params)
    core = core_on(tiny_llm, NGRAM)
    assert_same(expected, generate(core, prompts(), params))
    counters = core.speculator.counters
    assert counters.drafts > 0 and 0 < counters.accepted_tokens <= counters.draft_tokens
    assert counters.accepted_per_pos[0] >= counters.accepted_per_pos[-1]
    assert core.stats().extra["spec_decode_num_drafts"] == counters.drafts
    assert tiny_llm.core.runner.rows.occupancy().rows_used == 0


def test_rows_joining_at_different_steps_hold_exactly_what_was_accepted(tiny_llm: LLM) -> None:
    batch = prompts()
    params = [SamplingParams(max_new_tokens=12 + 5 * i) for i in range(len(batch))]
    expected = generate(core_on(tiny_llm), batch, params)
    core, rows = core_on(tiny_llm, NGRAM), tiny_llm.core.runner.rows
    requests: list[Request] = []
    got: list[list[int]] = []
    steps = 0
    while len(requests) < len(batch) or core.has_work():
        if len(requests) < len(batch) and steps % 2 == 0:  # a new row every other step
            request = core.make_request(batch[len(requests)], params[len(requests)])
            request.sink = token_collector(got)
            core.add(request)
            requests.append(request)
        core.step()
        steps += 1
        for request in core.scheduler.running:
            if request.output_ids:  # decoding: its row holds every id but the newest
                assert rows.length(request.row) == len(request.all_ids) - 1
    assert got == [c.token_ids for c in expected]
    assert core.speculator.counters.accepted_tokens > 0
    assert rows.occupancy().rows_used == 0


def token_collector(outputs: list[list[int]]):
    tokens: list[int] = []
    outputs.append(tokens)

    def sink(event: TokenEvent) -> None:
        if event.token_id >= 0:
            tokens.append(event.token_id)

    return sink


def emitted_per_step(core: EngineCore, prompt: list[int], params: SamplingParams) -> list[list[TokenEvent]]:
    """The events of one request, grouped by the step that emitted them."""
    events: list[TokenEvent] = []
    request = core.make_request(prompt, params)
    request.sink = events.append
    core.add(request)
    steps = []
    while core.has_work():
        seen = len(events)
        core.step()
        steps.append(events[seen:])
    return steps


def test_max_tokens_and_stop_ids_inside_an_accepted_run_cut_it_exactly(tiny_llm: LLM) -> None:
    prompt = repeating(2, 3, 6)
    reference = generate(core_on(tiny_llm), [prompt], SamplingParams(max_new_tokens=24))[0].token_ids
    steps = emitted_per_step(core_on(tiny_llm, NGRAM), prompt, SamplingParams(max_new_tokens=24))
    assert max(len(s) for s in steps) > 1, "no step emitted an accepted run"
    for n in range(1, 12):
        got = generate(core_on(tiny_llm, NGRAM), [prompt], SamplingParams(max_new_tokens=n))[0]
        assert got.token_ids == reference[:n] and got.finish_reason is FinishReason.LENGTH
    for j in (1, 2, 5, 9):
        stop = reference[j]
        params = SamplingParams(max_new_tokens=24, stop_token_ids=(stop,))
        got = generate(core_on(tiny_llm, NGRAM), [prompt], params)[0]
        assert got.token_ids == reference[: reference.index(stop) + 1]
        assert got.finish_reason is FinishReason.EOS_TOKEN
    assert tiny_llm.core.runner.rows.occupancy().rows_used == 0


def test_a_stop_sequence_inside_an_accepted_run_ends_the_text_there(tiny_llm: LLM) -> None:
    prompt = repeating(2, 3, 6)
    reference = generate(core_on(tiny_llm), [prompt], SamplingParams(max_new_tokens=24))[0]
    stop = tiny_llm.tokenizer.decode(reference.token_ids[4:6])
    params = SamplingParams(max_new_tokens=24, stop=(stop,))
    expected = generate(core_on(tiny_llm), [prompt], params)[0]
    got = generate(core_on(tiny_llm, NGRAM), [prompt], params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (
        expected.text,
        expected.token_ids,
        expected.finish_reason,
    )
    assert tiny_llm.core.runner.rows.occupancy().rows_used == 0


def test_sampled_speculation_is_reproducible_and_frees_its_rows(tiny_llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=20, temperature=0.7, top_k=50, seed=5)
    first = generate(core_on(tiny_llm, NGRAM), prompts(), params)
    core = core_on(tiny_llm, NGRAM)
    second = generate(core, prompts(), params)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert all(len(c.token_ids) == 20 or c.finish_reason is FinishReason.EOS_TOKEN for c in second)
    assert core.speculator.counters.drafts > 0
    assert tiny_llm.core.runner.rows.occupancy().rows_used == 0


def test_rows_that_cannot_speculate_decode_one_token_per_step(tiny_llm: LLM) -> None:
    core = core_on(tiny_llm, NGRAM)
    params = SamplingParams(max_new_tokens=10, repetition_penalty=1.3)
    expected = generate(core_on(tiny_llm), [repeating(1, 7, 4)], params)
    assert_same(expected, generate(core, [repeating(1, 7, 4)], params))
    assert core.speculator.counters.drafts == 0


@pytest.mark.parametrize(
    ("ids", "k", "low", "high", "draft"),
    [
        ([1, 2, 3, 4, 1, 2, 3], 2, 1, 3, [4, 1]),  # the longest suffix [1, 2, 3] occurs at 0
        ([1, 2, 3, 4, 1, 2, 3], 9, 1, 3, [4, 1, 2, 3]),  # at most what follows the match
        ([5, 9, 5, 7, 9], 3, 1, 2, [5, 7, 9]),  # [7, 9] never occurred; [9] first at 1
        ([1, 2, 1, 2], 3, 2, 3, [1, 2]),  # no 3-gram recurs: the 2-gram does
        ([1, 2, 3, 4], 3, 1, 3, []),  # nothing repeats
        ([1, 2, 1], 3, 3, 3, []),  # no longer than prompt_lookup_min
    ],
)
def test_ngram_proposal_is_vllms_prompt_lookup(ids, k, low, high, draft) -> None:
    assert propose_ngram(ids, k, low, high) == draft


def test_a_request_backs_off_after_drafts_with_nothing_accepted() -> None:
    speculator = Speculator(NGRAM, max_verify_tokens=64, n_positions=256)
    request = Request("r", [1, 2, 3, 1, 2, 3], SamplingParams(max_new_tokens=20), None, output_ids=[1])
    assert speculator.draft(request) == (2, 3, 1)  # after [2, 3, 1], first seen at position 1
    for _ in range(MISSES_BEFORE_PAUSE):
        speculator.observe(request, 3, 0)
    assert [speculator.draft(request) for _ in range(PAUSE_STEPS)] == [()] * PAUSE_STEPS
    assert speculator.draft(request) == (2, 3, 1)
    speculator.observe(request, 3, 1)
    assert request.spec_misses == 0 and speculator.counters.accepted_per_pos == [1, 0, 0, 0]
    short = Request("s", [1, 2, 3, 1, 2, 3], SamplingParams(max_new_tokens=3), None, output_ids=[1])
    assert speculator.draft(short) == (2,)  # the model's own token always follows the drafts


def test_the_cost_line_is_fitted_from_the_forwards_seen() -> None:
    cost = DraftCost()
    assert cost.line() is None and cost.break_even(16) is None
    cost.observe(16, 0.018 + 0.00133 * 16)
    cost.observe(16, 0.018 + 0.00133 * 16)
    assert cost.line() is None  # one size of forward gives no slope
    for tokens in (20, 48, 33, 64, 17):
        cost.observe(tokens, 0.018 + 0.00133 * tokens)
    a, b = cost.line()
    assert a == pytest.approx(0.018, rel=1e-6) and b == pytest.approx(0.00133, rel=1e-6)
    assert cost.break_even(16) == pytest.approx(0.00133 * 16 / (0.018 + 0.00133 * 16))
    assert cost.break_even(1) < 0.1  # at batch 1 nearly any draft pays
    noisy = DraftCost()
    for tokens, seconds in ((4, 0.001), (40, 0.020), (8, 0.002)):  # the fit crosses 0 below 1 token
        noisy.observe(tokens, seconds)
    assert noisy.line() is None and noisy.break_even(16) is None  # no cap from a line like that


def test_drafts_are_capped_by_what_they_are_worth() -> None:
    """A fresh row at the batch-16 line above drafts while 0.8 ** j > 0.54 (one token); a row whose
    drafts are accepted drafts all k; one whose drafts fail drafts none, forgets that while idle,
    and tries again. A seeded sampled row drafts what the lookup finds (its tokens stay the seed's)."""
    cost = DraftCost()
    for tokens in (16, 20, 48, 33, 64, 17):
        cost.observe(tokens, 0.018 + 0.00133 * tokens)
    speculator = Speculator(NGRAM, max_verify_tokens=64, n_positions=256)
    speculator.cost = cost
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3]

    def row(name: str, **params: object) -> Request:
        return Request(name, list(ids), SamplingParams(max_new_tokens=50, **params), None, output_ids=[4])

    fresh = row("fresh")
    assert acceptance(fresh) == pytest.approx(0.8)
    assert worth_drafting(fresh, cost.break_even(16), 4) == 2  # 0.8 ** 2 = 0.64 > 0.54 > 0.8 ** 3
    assert len(speculator.draft(fresh, cost.break_even(16))) == 2
    assert len(speculator.draft(fresh, cost.break_even(1))) == 4
    good, bad = row("good"), row("bad")
    for _ in range(6):
        speculator.observe(good, 4, 4)
        speculator.observe(bad, 2, 1)
    assert len(speculator.draft(good, cost.break_even(16))) == 4
    assert speculator.draft(bad, cost.break_even(16)) == ()
    idle = 1
    while not speculator.draft(bad, cost.break_even(16)):  # drifting back towards the prior
        idle += 1
        assert idle < 30
    seeded = row("seeded", temperature=0.7, seed=3)
    for _ in range(6):
        speculator.observe(seeded, 2, 0)
        seeded.spec_misses = 0  # (no pause: the cap alone is under test)
    assert len(speculator.draft(seeded, cost.break_even(16))) == 4


def total_variation(draws: list[int], probs: torch.Tensor) -> float:
    counts = Counter(draws)
    return 0.5 * sum(abs(counts[t] / len(draws) - float(p)) for t, p in enumerate(probs))


@pytest.mark.parametrize(
    ("draft", "temperature", "top_k"),
    [(0, 1.0, 0), (4, 1.0, 0), (2, 0.7, 4)],  # the likeliest token, an unlikely one, a filtered row
)
def test_rejection_sampling_keeps_the_target_distribution(draft: int, temperature: float, top_k: int) -> None:
    raw = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 1.0, -0.5, 2.0, 0.3, -2.0]])
    logits = sampling_logits(raw, SamplingParams(temperature=temperature, top_k=top_k))
    target = torch.softmax(logits, dim=-1)
    generator = torch.Generator().manual_seed(1234)
    n = 6000
    runs = [rejection_sample(logits, [draft], generator) for _ in range(n)]
    assert total_variation([run[0] for run in runs], target[0]) < 0.03
    # After an accepted draft the bonus token comes from the next position's distribution.
    bonus = [run[1] for run in runs if len(run) == 2]
    accepted = n * float(target[0, draft])
    assert abs(len(bonus) - accepted) < 4 * math.sqrt(accepted) + 1
    assert total_variation(bonus, target[1]) < 1.5 / math.sqrt(len(bonus))
    assert all(len(run) == 1 for run in runs if run[0] != draft)


def test_speculation_is_refused_at_start_up_naming_the_key(tiny_llm: LLM, tiny_llama_dir: Path) -> None:
    with pytest.raises(
        ValueError, match=r"option\.speculative_config: method 'draft_model' is not supported yet"
    ):
        core_on(tiny_llm, SpeculativeConfig("draft_model", 3, model="some/draft"))
    small = CpuRunner(tiny_llm.core.runner.model, 2, 256, context_buckets=[4])
    with pytest.raises(ValueError, match=r"option\.speculative_config: num_speculative_tokens=4.*at most 3"):
        EngineCore(small, tiny_llm.core.tokenizer, [], speculative=NGRAM)
    with pytest.raises(ValueError, match=r"option\.speculative_config.*cannot verify several tokens"):
        LLM(
            str(tiny_llama_dir),
            dtype="fp32",
            enforce_eager=True,
            tensor_parallel_degree=2,
            n_positions=64,
            max_rolling_batch_size=2,
            speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
        )
