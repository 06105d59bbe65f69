"""Draft-model speculation on the real CPU engine (tiny random Llama target, fp32, eager): greedy output
is the output without speculation, a draft of the target itself is always accepted, both caches'
rows hold what they should and are all freed; the rejection sampler keeps the target distribution for
a full draft distribution q; bad drafts are refused at start-up naming the key."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from neuron_lmi.backends.cpu.engine import draft_runner
from neuron_lmi.backends.cpu.llm import LLM
from neuron_lmi.backends.cpu.runner import CpuRunner
from neuron_lmi.config.speculative import DRAFT_MODEL, SpeculativeConfig
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.draft_model import DraftModelProposer
from neuron_lmi.engine.scheduler import ChunkedPrefill
from neuron_lmi.engine.speculation import DraftCost, rejection_sample, sampling_logits
from neuron_lmi.engine.types import FinishReason, SamplingParams

from ..conftest import cpu_options
from .conftest import random_prompts
from .test_speculation import assert_same, emitted_per_step, generate, prompts, repeating, token_collector

ROWS, POSITIONS = 16, 256


@pytest.fixture(autouse=True)
def no_cost_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost cap reads timings (a draft as large as its target is rarely worth it); it cannot
    change a greedy row's tokens, so it is off here and every step drafts what it may."""
    monkeypatch.setattr(DraftCost, "break_even", lambda self, rows, proposing=0.0: None)


@pytest.fixture(scope="module")
def perturbed_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with noise on its layers' weights: a draft that agrees with it often, not always."""
    out = tmp_path_factory.mktemp("draft") / "perturbed"
    shutil.copytree(tiny_llama_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    for name, tensor in weights.items():
        if name.startswith("model.layers.") and tensor.dim() == 2:
            tensor += 0.5 * tensor.std() * torch.randn(tensor.shape, generator=generator)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def draft_config(model: Path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(DRAFT_MODEL, k, model=str(model))


def build_draft(model: Path, tokenizer) -> CpuRunner:
    options = replace(cpu_options(model, max_rolling_batch_size=ROWS), speculative_config=draft_config(model))
    runner = draft_runner(options, POSITIONS, tokenizer)
    assert runner is not None
    return runner


@pytest.fixture(scope="module")
def perturbed_draft(perturbed_dir: Path, tiny_llm: LLM) -> CpuRunner:
    return build_draft(perturbed_dir, tiny_llm.core.tokenizer)


@pytest.fixture(scope="module")
def self_draft(tiny_llama_dir: Path, tiny_llm: LLM) -> CpuRunner:
    return build_draft(tiny_llama_dir, tiny_llm.core.tokenizer)


def core_with(llm: LLM, draft: CpuRunner | None, k: int = 4, **kwargs) -> EngineCore:
    core = llm.core
    spec = draft_config(Path("draft"), k) if draft is not None else None
    return EngineCore(
        core.runner, core.tokenizer, core.eos_token_ids, speculative=spec, draft_runner=draft, **kwargs
    )


def assert_no_rows_held(llm: LLM, draft: CpuRunner) -> None:
    assert llm.core.runner.rows.occupancy().rows_used == 0
    assert draft.rows.occupancy().rows_used == 0


def test_greedy_output_is_token_identical_with_a_draft_model(
    tiny_llm: LLM, perturbed_draft: CpuRunner
) -> None:
    params = SamplingParams(max_new_tokens=32)
    batch = [*prompts(), *random_prompts([9, 30], seed=8)]
    expected = generate(core_with(tiny_llm, None), batch, params)
    core = core_with(tiny_llm, perturbed_draft)
    assert_same(expected, generate(core, batch, params))
    counters = core.speculator.counters
    assert counters.drafts > 0 and 0 < counters.accepted_tokens < counters.draft_tokens
    assert_no_rows_held(tiny_llm, perturbed_draft)


def test_a_draft_of_the_target_itself_is_always_accepted(tiny_llm: LLM, self_draft: CpuRunner) -> None:
    params = SamplingParams(max_new_tokens=40)
    batch = prompts()
    expected = generate(core_with(tiny_llm, None), batch, params)
    core = core_with(tiny_llm, self_draft)
    assert_same(expected, generate(core, batch, params))
    counters = core.speculator.counters
    assert counters.drafts > 0
    assert counters.accepted_tokens == counters.draft_tokens  # acceptance 1.0
    assert counters.accepted_per_pos[0] == counters.drafts
    assert_no_rows_held(tiny_llm, self_draft)


def test_rows_joining_at_different_steps_hold_what_was_accepted(
    tiny_llm: LLM, perturbed_draft: CpuRunner
) -> None:
    batch = prompts()
    params = [SamplingParams(max_new_tokens=10 + 5 * i) for i in range(len(batch))]
    expected = generate(core_with(tiny_llm, None), batch, params)
    core, rows = core_with(tiny_llm, perturbed_draft), tiny_llm.core.runner.rows
    got: list[list[int]] = []
    added, steps = 0, 0
    while added < len(batch) or core.has_work():
        if added < len(batch) and steps % 2 == 0:
            request = core.make_request(batch[added], params[added])
            request.sink = token_collector(got)
            core.add(request)
            added += 1
        core.step()
        steps += 1
        drafting = perturbed_draft.rows.in_use()
        for request in core.scheduler.running:
            if request.output_ids:
                assert rows.length(request.row) == len(request.all_ids) - 1
            if request.row in drafting:  # the request's ids at most, and k - 1 unverified drafts
                assert perturbed_draft.rows.length(request.row) <= len(request.all_ids) + 3
        assert set(drafting) <= {r.row for r in core.scheduler.running}
    assert got == [c.token_ids for c in expected]
    assert_no_rows_held(tiny_llm, perturbed_draft)


def test_max_tokens_and_stop_ids_inside_an_accepted_run_cut_it_exactly(
    tiny_llm: LLM, self_draft: CpuRunner
) -> None:
    prompt = random_prompts([12], seed=11)[0]
    reference = generate(core_with(tiny_llm, None), [prompt], SamplingParams(max_new_tokens=24))[0].token_ids
    steps = emitted_per_step(core_with(tiny_llm, self_draft), prompt, SamplingParams(max_new_tokens=24))
    assert max(len(s) for s in steps) == 5, "every verify should emit k + 1 tokens"
    for n in (1, 2, 3, 6, 7, 11):
        got = generate(core_with(tiny_llm, self_draft), [prompt], SamplingParams(max_new_tokens=n))[0]
        assert got.token_ids == reference[:n] and got.finish_reason is FinishReason.LENGTH
    for j in (1, 3, 7):
        stop = reference[j]
        params = SamplingParams(max_new_tokens=24, stop_token_ids=(stop,))
        got = generate(core_with(tiny_llm, self_draft), [prompt], params)[0]
        assert got.token_ids == reference[: reference.index(stop) + 1]
        assert got.finish_reason is FinishReason.EOS_TOKEN
    assert_no_rows_held(tiny_llm, self_draft)


def test_chunked_prefill_and_prefix_reuse_stay_exact(tiny_llm: LLM, perturbed_draft: CpuRunner) -> None:
    """Long prompts in 8-token chunks, sharing a prefix; run twice, so the second round claims the
    rows the first retained (the target's and the draft's)."""
    shared = random_prompts([40], seed=21)[0]
    batch = [shared + tail for tail in random_prompts([3, 17, 9], seed=22)] + [repeating(5, 6, 8)]
    params = SamplingParams(max_new_tokens=20)
    chunked = ChunkedPrefill(step_tokens=24, min_chunk=8)
    expected = generate(core_with(tiny_llm, None, prefill=chunked), batch, params)
    core = core_with(tiny_llm, perturbed_draft, prefill=chunked)
    for _ in range(2):
        assert_same(expected, generate(core, batch, params))
    assert core.speculator.counters.accepted_tokens > 0
    assert_no_rows_held(tiny_llm, perturbed_draft)


def test_sampled_drafts_are_reproducible_and_free_their_rows(
    tiny_llm: LLM, perturbed_draft: CpuRunner
) -> None:
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=40, seed=3)
    first = generate(core_with(tiny_llm, perturbed_draft), prompts(), params)
    core = core_with(tiny_llm, perturbed_draft)
    second = generate(core, prompts(), params)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert all(len(c.token_ids) == 20 or c.finish_reason is FinishReason.EOS_TOKEN for c in second)
    assert core.speculator.counters.drafts > 0
    assert_no_rows_held(tiny_llm, perturbed_draft)


def test_a_sampled_draft_of_the_target_itself_is_accepted(tiny_llm: LLM, self_draft: CpuRunner) -> None:
    """q == p (up to rounding), so min(1, p / q) accepts nearly every draft."""
    core = core_with(tiny_llm, self_draft)
    generate(core, prompts(), SamplingParams(max_new_tokens=24, temperature=1.0, seed=4))
    counters = core.speculator.counters
    assert counters.accepted_tokens >= 0.97 * counters.draft_tokens > 0
    assert_no_rows_held(tiny_llm, self_draft)


def total_variation(draws: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(draws), minlength=probs.shape[0]).float() / len(draws)
    return 0.5 * float((counts - probs).abs().sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejection_sampling_with_a_full_q_keeps_the_target_distribution(temperature: float) -> None:
    raw = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 1.0, -0.5, 2.0, 0.3, -2.0]])
    logits = sampling_logits(raw, SamplingParams(temperature=temperature))
    target = torch.softmax(logits, dim=-1)
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, -1.0]), dim=-1)  # far from p
    generator = torch.Generator().manual_seed(99)
    first, bonus = [], []
    for _ in range(8000):
        draft = int(torch.multinomial(q, 1, generator=generator))
        run = rejection_sample(logits, [draft], generator, q[None])
        first.append(run[0])
        if len(run) == 2:
            bonus.append(run[1])
    assert total_variation(first, target[0]) < 0.03
    assert total_variation(bonus, target[1]) < 0.05
    accepted = float(torch.minimum(target[0], q).sum())  # P(accept) = sum min(p, q)
    assert abs(len(bonus) / 8000 - accepted) < 0.03


def test_the_draft_cache_must_cover_the_targets(tiny_llm: LLM, perturbed_draft: CpuRunner) -> None:
    small = CpuRunner(perturbed_draft.model, 2, 64)
    with pytest.raises(
        ValueError, match=r"option\.speculative_config: the draft model's cache \(2 rows x 64"
    ):
        DraftModelProposer(
            small, tiny_llm.core.runner.vocab_size, ROWS, POSITIONS, "option.speculative_config"
        )


def test_lmi_keys_run_a_draft_model_through_the_python_api(tiny_llama_dir: Path, perturbed_dir: Path) -> None:
    keys = {"dtype": "fp32", "enforce_eager": True, "max_rolling_batch_size": 4, "n_positions": 128}
    plain = LLM(str(tiny_llama_dir), **keys)
    llm = LLM(str(tiny_llama_dir), speculative_draft_model=str(perturbed_dir), speculative_length=3, **keys)
    spec = llm.core.speculator.config
    assert (spec.method, spec.num_speculative_tokens, spec.key) == (
        "draft_model",
        3,
        "option.speculative_draft_model",
    )
    params = SamplingParams(max_new_tokens=16)
    batch = prompts()[:3]
    assert_same(plain.generate(batch, params), llm.generate(batch, params))
    assert llm.core.speculator.counters.drafts > 0


def test_bad_drafts_are_refused_at_start_up_naming_the_key(
    tiny_llama_dir: Path, copy_dir, tmp_path: Path
) -> None:
    keys = {"dtype": "fp32", "enforce_eager": True, "max_rolling_batch_size": 2, "n_positions": 64}
    missing = tmp_path / "no-such-draft"
    config = json.dumps({"method": "draft_model", "model": str(missing), "num_speculative_tokens": 2})
    with pytest.raises(
        ValueError, match=r"option\.speculative_config: draft model .*no-such-draft.* cannot be"
    ):
        LLM(str(tiny_llama_dir), speculative_config=config, **keys)
    with pytest.raises(ValueError, match=r"option\.speculative_draft_model: draft model .*no-such-draft"):
        LLM(str(tiny_llama_dir), speculative_draft_model=str(missing), **keys)
    other = copy_dir(tiny_llama_dir, "other-vocab")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(other))
    tokenizer.add_tokens(["<only-in-the-draft>"])
    tokenizer.save_pretrained(str(other))
    config = json.dumps({"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"option\.speculative_config: draft model .* has another tokenizer"):
        LLM(str(tiny_llama_dir), speculative_config=config, **keys)
