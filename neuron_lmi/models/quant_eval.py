"""How far a quantized (or bf16) model is from its reference: the two numbers the quantization
benchmark prints and the tests bound.

* :func:`token_agreement`: the reference's greedy continuation of each prompt is fed to both models
  (teacher forcing) and the share of positions where the candidate's top-1 token equals the
  reference's is counted. Unlike comparing two free-running generations, one early flip does not
  make every later position disagree.
* :func:`perplexity`: ``exp`` of the mean next-token negative log-likelihood of a fixed text.

Both read every position's logits through ``prefill_packed`` (one sequence, one segment).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from neuron_lmi.models.llama import LlamaForCausalLM


def all_logits(model: LlamaForCausalLM, ids: Sequence[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab]: row ``i`` predicts token ``i + 1``."""
    t = len(ids)
    tokens = torch.tensor([list(ids)], dtype=torch.long)
    positions = torch.arange(t)[None]
    last = (torch.zeros(t, dtype=torch.long), torch.arange(t))
    logits, _, _ = model.prefill_packed(tokens, positions, torch.zeros_like(positions), last)
    return logits


def greedy(model: LlamaForCausalLM, prompt: Sequence[int], n_new: int) -> list[int]:
    """``model``'s greedy continuation of ``prompt``, ``n_new`` tokens (no cache: for tiny models)."""
    ids = list(prompt)
    for _ in range(n_new):
        ids.append(int(all_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def token_agreement(
    reference: LlamaForCausalLM,
    candidate: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
) -> float:
    """Share of continuation positions where ``candidate``'s top-1 equals ``reference``'s, both fed
    prompt + ``continuations`` (the reference's greedy tokens)."""
    agree = total = 0
    for prompt, cont in zip(prompts, continuations, strict=True):
        ids = [*prompt, *cont]
        span = slice(len(prompt) - 1, len(ids) - 1)  # the rows that predict the continuation
        ref = all_logits(reference, ids)[span].argmax(-1)
        got = all_logits(candidate, ids)[span].argmax(-1)
        agree += int((ref == got).sum())
        total += len(cont)
    return agree / total


def perplexity(model: LlamaForCausalLM, ids: Sequence[int]) -> float:
    """``exp`` of the mean negative log-likelihood of ``ids[1:]`` given the tokens before each."""
    logits = all_logits(model, ids)[:-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(list(ids[1:]), dtype=torch.long))
    return float(torch.exp(nll))
