"""Batched, stateless sampling: one call per step for every row that produced logits.

Reported log-probabilities are the model's own distribution (``log_softmax`` of the raw logits),
independent of temperature and filters, as TGI and vLLM report them. Each request draws from its
own ``torch.Generator``, so a seeded request samples the same tokens whatever else is batched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from neuron_lmi.engine.types import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def apply_repetition_penalty(
    logits: torch.Tensor, histories: Sequence[Sequence[int]], penalties: Sequence[float]
) -> torch.Tensor:
    """CTRL-style penalty: seen tokens' positive logits are divided, negative ones multiplied."""
    for i, (history, penalty) in enumerate(zip(histories, penalties, strict=True)):
        if penalty == 1.0 or not history:
            continue
        seen = torch.tensor(sorted(set(history)), dtype=torch.long)
        values = logits[i, seen]
        logits[i, seen] = torch.where(values > 0, values / penalty, values * penalty)
    return logits


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus of one row."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> SampleOutput:
    """Choose one token per row of ``logits`` [B, vocab] (fp32)."""
    logprobs_all = torch.log_softmax(logits, dim=-1)
    penalized = logits
    if any(p.repetition_penalty != 1.0 for p in params):
        penalized = apply_repetition_penalty(
            logits.clone(), histories, [p.repetition_penalty for p in params]
        )
    chosen = penalized.argmax(dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = filter_top_k_top_p(penalized[i] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        chosen[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    chosen_logprobs = logprobs_all.gather(1, chosen[:, None])[:, 0]
    max_top = max((p.top_n_tokens for p in params), default=0)
    top_ids: list[list[int]] = [[] for _ in params]
    top_lps: list[list[float]] = [[] for _ in params]
    if max_top:
        values, indices = torch.topk(logprobs_all, max_top, dim=-1)
        for i, p in enumerate(params):
            top_ids[i] = indices[i, : p.top_n_tokens].tolist()
            top_lps[i] = values[i, : p.top_n_tokens].tolist()
    return SampleOutput(chosen.tolist(), chosen_logprobs.tolist(), top_ids, top_lps)
