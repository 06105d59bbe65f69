from __future__ import annotations

import dataclasses

import pytest
import torch

from neuron_lmi.engine.sampling import apply_repetition_penalty, filter_top_k_top_p, greedy_argmax, sample
from neuron_lmi.engine.types import InvalidRequestError, SamplingParams


def test_greedy_picks_argmax_and_reports_model_logprob():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, -1.0]])
    out = sample(logits, [SamplingParams(), SamplingParams()], [[], []], [None, None])
    assert out.tokens == [1, 0]
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    assert out.logprobs == pytest.approx(expected.tolist())


def test_seeded_sampling_is_reproducible_and_batch_independent():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(rows: list[int]) -> list[int]:
        gens = [torch.Generator().manual_seed(7) for _ in rows]
        tokens = []
        for _ in range(20):
            tokens.append(sample(logits[rows], [params] * len(rows), [[]] * len(rows), gens).tokens[0])
        return tokens

    assert draw([0]) == draw([0, 1, 2])
    assert len(set(draw([0]))) > 1  # it really samples


def test_top_k_keeps_only_k_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    kept = filter_top_k_top_p(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(kept).tolist() == [True, True, False, False, False]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_top_k_top_p(probs.log(), top_k=0, top_p=0.8)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_top_k_top_p(probs.log(), 0, 0.01)).sum() == 1


def test_repetition_penalty_lowers_seen_tokens_both_signs():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits.clone(), [[0, 1]], [2.0])
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_top_n_tokens_are_sorted_alternatives():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0]])
    out = sample(logits, [SamplingParams(top_n_tokens=3)], [[]], [None])
    assert out.top_ids == [[1, 3, 2]]
    assert out.top_logprobs[0] == sorted(out.top_logprobs[0], reverse=True)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("max_new_tokens", {"max_new_tokens": 0}),
        ("max_new_tokens", {"max_new_tokens": -3}),
        ("temperature", {"temperature": -0.5}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -1}),
        ("repetition_penalty", {"repetition_penalty": 0.0}),
        ("stop", {"stop": ("",)}),
        ("top_n_tokens", {"top_n_tokens": 1000}),
        ("seed", {"seed": -1}),
    ],
)
def test_out_of_range_parameters_name_the_field(field, kwargs):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate()
    assert info.value.field == field
    assert field.split("_")[0] in str(info.value)


@pytest.mark.parametrize("vocab", [49152, 32000, 1000, 300])
def test_greedy_argmax_is_argmax_first_index_on_ties(vocab: int) -> None:
    torch.manual_seed(vocab)
    x = torch.randn(9, vocab)
    x[3, 700 % vocab] = x[3, 900 % vocab] = 50.0  # a tie: the first index wins
    x[5] = 0.0  # all equal
    x[6, : vocab // 2] = float("-inf")
    assert torch.equal(greedy_argmax(x), x.argmax(dim=-1))
    assert int(greedy_argmax(x)[5]) == 0 and int(greedy_argmax(x)[3]) == min(700 % vocab, 900 % vocab)


def test_a_batch_that_reads_no_logprobs_gets_the_same_tokens_and_reports_zero() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 512)
    histories = [[1, 2]] * 4
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    asked = [SamplingParams(), SamplingParams(temperature=0.7, seed=1)] * 2
    quiet = [dataclasses.replace(p, logprobs=False) for p in asked]
    full = sample(logits, asked, histories, gens)
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    skipped = sample(logits, quiet, histories, gens)
    assert skipped.tokens == full.tokens and skipped.logprobs == [0.0] * 4
    assert all(lp < 0 for lp in full.logprobs)
    mixed = sample(logits[[0, 2]], [quiet[0], asked[2]], histories[:2], [None, None])  # greedy both
    assert mixed.tokens == [full.tokens[0], full.tokens[2]]
    assert mixed.logprobs[1] == pytest.approx(full.logprobs[2])  # one row asks: reported
