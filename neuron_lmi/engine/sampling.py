"""Batched, stateless sampling: one call per step for every row that produced logits.

Every row goes through the same tensor pipeline; a feature a row does not use is a neutral value
in its row (and a feature no row uses is skipped), so a request pays only for what it asks:

    raw logits ──> log_softmax (reported log-probabilities)
        │
        ├─ repetition penalty (seen prompt + output tokens)    ├─ presence / frequency penalty
        ├─ logit_bias                                          ├─ grammar mask (GrammarState)
        ├─ min_tokens: stop tokens masked                      └─ argmax (greedy rows)
        └─ / temperature ─> min_p ─> top_k ─> top_p ─> inverse-CDF draw of softmax (sampled rows:
                                                         ``models.token_draw``, no probabilities written)

Reported log-probabilities are the model's own distribution (``log_softmax`` of the raw logits),
independent of penalties, temperature and filters, as TGI and vLLM report them. A batch whose
requests all leave ``SamplingParams.logprobs`` off (and ask for no top tokens) skips the
``log_softmax`` over the vocabulary and reports 0.0, as vLLM does: at 64 rows it is the step's
largest host cost. Each sampled row
draws one uniform number from its request's own ``torch.Generator``, so a seeded request samples
the same tokens whatever else is batched. Python loops here run over requests only, to build small
index tensors; nothing loops over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from neuron_lmi.engine.grammar import GrammarState, allowed_tokens
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.models import ops
from neuron_lmi.models.token_draw import draw_from_logits

NEG_INF = float("-inf")
TOP_CANDIDATES = 1024  # top_k/top_p look at this many most likely tokens first (filter_logits)
ARGMAX_BLOCK = 256  # greedy_argmax's block: whole rows of block maxima, then one block scanned


@dataclass(frozen=True, slots=True)
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def _index(lists: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors for every id of every row's list."""
    rows = [i for i, ids in enumerate(lists) for _ in ids]
    cols = [int(t) for ids in lists for t in ids]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)


def token_counts(lists: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """How often each token occurs in each row's list: ``[len(lists), vocab_size]`` fp32."""
    counts = torch.zeros(len(lists), vocab_size)
    rows, cols = _index(lists)
    return counts.index_put_((rows, cols), torch.ones(len(cols)), accumulate=True)


def apply_repetition_penalty(
    logits: torch.Tensor, histories: Sequence[Sequence[int]], penalties: Sequence[float]
) -> torch.Tensor:
    """CTRL-style penalty: seen tokens' positive logits are divided, negative ones multiplied."""
    penalty = torch.tensor(list(penalties), dtype=logits.dtype)[:, None]
    seen = token_counts(histories, logits.shape[-1]) > 0
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)


def apply_additive_penalties(
    logits: torch.Tensor,
    outputs: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
) -> torch.Tensor:
    """OpenAI's definition, over the generated tokens only:
    ``logits -= presence * (count > 0) + frequency * count``."""
    counts = token_counts(outputs, logits.shape[-1])
    pres = torch.tensor(list(presence), dtype=logits.dtype)[:, None]
    freq = torch.tensor(list(frequency), dtype=logits.dtype)[:, None]
    return logits - pres * (counts > 0) - freq * counts


def apply_logit_bias(logits: torch.Tensor, biases: Sequence[Sequence[tuple[int, float]]]) -> torch.Tensor:
    rows = torch.tensor([i for i, bias in enumerate(biases) for _ in bias], dtype=torch.long)
    cols = torch.tensor([t for bias in biases for t, _ in bias], dtype=torch.long)
    values = torch.tensor([b for bias in biases for _, b in bias], dtype=logits.dtype)
    return logits.index_put((rows, cols), values, accumulate=True)


def apply_grammar(logits: torch.Tensor, grammars: Sequence[GrammarState | None]) -> torch.Tensor:
    """Mask every token the row's grammar does not allow next (rows without one are untouched)."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    allowed = allowed_tokens([grammars[i] for i in rows], logits.shape[-1])  # type: ignore[misc]
    index = torch.tensor(rows, dtype=torch.long)
    logits[index] = logits[index].masked_fill(~allowed, NEG_INF)
    return logits


def mask_stop_tokens(logits: torch.Tensor, rows: Sequence[int], stop_ids: Sequence[int]) -> torch.Tensor:
    """``min_tokens``: forbid the stop tokens in ``rows``, unless nothing else is allowed there
    (a grammar that is complete allows only EOS; the grammar wins)."""
    index = torch.tensor(list(rows), dtype=torch.long)
    stops = torch.tensor([t for t in stop_ids if t < logits.shape[-1]], dtype=torch.long)
    masked = logits[index]
    masked[:, stops] = NEG_INF
    keep = torch.isfinite(masked).any(dim=-1)
    logits[index[keep]] = masked[keep]
    return logits


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) what each row's min_p, top_k and top_p exclude; ``logits`` is ``[B, vocab]``,
    the others ``[B]`` (0, 1.0 and 0.0 disable them). The most likely token always stays.

    top_k applies first, top_p to what it leaves (renormalised). The candidates are the
    ``TOP_CANDIDATES`` most likely tokens (or the largest top_k, when every row sets one) rather than
    a sort of the whole vocabulary (which cost more than a model step: docs/measurements.md); the whole
    vocabulary is sorted only when some row's top_p mass is not reached within the candidates.
    """
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, NEG_INF)
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    active = (k < vocab) | (top_p < 1.0)
    if not bool(active.any()):
        return logits
    if not bool(active.all()):  # rows that filter nothing keep their whole vocabulary
        out = logits.clone()
        out[active] = _filter_rows(logits[active], k[active], top_p[active])
        return out
    return _filter_rows(logits, k, top_p)


def _filter_rows(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """top_k then top_p for rows that each set at least one of them (``k`` = vocab: no top_k)."""
    vocab = logits.shape[-1]
    limited = k < vocab
    largest_k = int(k[limited].max()) if bool(limited.any()) else 0
    width = largest_k if bool(limited.all()) else max(TOP_CANDIDATES, largest_k)
    if width < vocab:
        values, order = torch.topk(logits, width, dim=-1)  # sorted, most likely first
        # A row without top_k needs its top_p mass inside the candidates (full-vocabulary softmax).
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        reach = torch.exp(values - lse).sum(dim=-1)
        if not bool((~limited & (reach < top_p)).any()):
            kept = _top_k_top_p(values, k, top_p, torch.where(limited[:, None], NEG_INF, lse))
            return torch.full_like(logits, NEG_INF).scatter(-1, order, kept)
    values, order = torch.sort(logits, dim=-1, descending=True)
    return torch.full_like(logits, NEG_INF).scatter(-1, order, _top_k_top_p(values, k, top_p))


def _top_k_top_p(
    values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """``values`` sorted descending per row (the head of the vocabulary, or all of it): -inf past each
    row's ``k``, then past the smallest prefix whose mass reaches ``top_p`` (the first always stays).

    ``lse`` ([B, 1]) is the whole vocabulary's log-normaliser for rows without top_k when ``values``
    is only the head (-inf for the others, which renormalise over their k tokens): their mass then
    counts as over the whole vocabulary, so the prefix found is the same, up to ties."""
    ranks = torch.arange(values.shape[-1])[None, :]
    values = values.masked_fill(ranks >= k[:, None], NEG_INF)
    probs = torch.softmax(values, dim=-1)
    if lse is not None:
        probs = torch.where(torch.isfinite(lse), torch.exp(values - lse), probs)
    drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (ranks > 0)
    return values.masked_fill(drop, NEG_INF)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``filter_logits`` for one row ``[vocab]``."""
    return filter_logits(logits[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([0.0]))[0]


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``[B, vocab]``, first index on ties, in two levels: each block's
    maximum (``amax`` is vectorized, unlike the index-tracking reductions), the first block holding
    the row's maximum, then the index within that block. Plain ``argmax`` where blocks do not fit."""
    n, vocab = x.shape
    if vocab % ARGMAX_BLOCK or vocab < 2 * ARGMAX_BLOCK:
        return x.argmax(dim=-1)
    blocks = x.view(n, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    block = blocks.amax(dim=-1).argmax(dim=-1)
    inner = blocks[torch.arange(n), block].argmax(dim=-1)
    return block * ARGMAX_BLOCK + inner


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    grammars: Sequence[GrammarState | None],
    stop_ids: Sequence[int],
) -> torch.Tensor:
    """The logits sampling chooses from: penalties, bias and masks applied (``logits`` itself when
    no row uses any of them, else a new tensor; ``logits`` is never modified)."""
    x = logits
    if any(p.repetition_penalty != 1.0 for p in params):
        x = apply_repetition_penalty(x, histories, [p.repetition_penalty for p in params])
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        x = apply_additive_penalties(
            x, outputs, [p.presence_penalty for p in params], [p.frequency_penalty for p in params]
        )
    if any(p.logit_bias for p in params):
        x = apply_logit_bias(x, [p.logit_bias for p in params])
    if any(g is not None for g in grammars):
        x = apply_grammar(x.clone() if x is logits else x, grammars)
    early = [i for i, p in enumerate(params) if len(outputs[i]) < p.min_tokens]
    if early and stop_ids:
        x = mask_stop_tokens(x.clone() if x is logits else x, early, stop_ids)
    return x


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    outputs: Sequence[Sequence[int]] | None = None,
    grammars: Sequence[GrammarState | None] | None = None,
    stop_ids: Sequence[int] = (),
) -> SampleOutput:
    """Choose one token per row of ``logits`` [B, vocab] (fp32).

    ``histories`` are prompt + output ids (repetition penalty), ``outputs`` the generated ids alone
    (presence/frequency penalties, ``min_tokens``), ``grammars`` each row's grammar state or None,
    ``stop_ids`` the tokens ``min_tokens`` holds back (EOS).
    """
    outputs = outputs if outputs is not None else [[] for _ in params]
    grammars = grammars if grammars is not None else [None] * len(params)
    max_top = max((p.top_n_tokens for p in params), default=0)
    reported = max_top > 0 or any(p.logprobs for p in params)
    logprobs_all = torch.log_softmax(logits, dim=-1) if reported else None
    x = process_logits(logits, params, histories, outputs, grammars, stop_ids)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    every = len(rows) == len(params)
    chosen = torch.empty(len(params), dtype=torch.long) if every else greedy_argmax(x)
    if rows:
        sub = [params[i] for i in rows]
        scaled = x if every else x[rows]
        if any(p.temperature != 1.0 for p in sub):
            scaled = scaled / torch.tensor([p.temperature for p in sub])[:, None]
        filtered = filter_logits(
            scaled,
            torch.tensor([p.top_k for p in sub]),
            torch.tensor([p.top_p for p in sub]),
            torch.tensor([p.min_p for p in sub]),
        )
        ops.kernels()  # the draw's kernel: an engine registers it at start-up, a direct caller here
        picked = draw_from_logits(filtered, [generators[i] for i in rows])
        chosen = picked if every else chosen.index_put_((torch.tensor(rows),), picked)
    if logprobs_all is None:
        chosen_logprobs = [0.0] * len(params)
    else:
        chosen_logprobs = logprobs_all.gather(1, chosen[:, None])[:, 0].tolist()
    top_ids: list[list[int]] = [[] for _ in params]
    top_lps: list[list[float]] = [[] for _ in params]
    if max_top:
        values, indices = torch.topk(logprobs_all, max_top, dim=-1)  # type: ignore[arg-type]
        for i, p in enumerate(params):
            top_ids[i] = indices[i, : p.top_n_tokens].tolist()
            top_lps[i] = values[i, : p.top_n_tokens].tolist()
    return SampleOutput(chosen.tolist(), chosen_logprobs, top_ids, top_lps)


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: Sequence[int], top_n: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Score a prompt from its logits ``[T, vocab]`` (position t predicts token t + 1): each token's
    log-probability given the ones before it (from the second token on, ``T - 1`` values) and the
    ``top_n`` most likely tokens at each of those positions."""
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    targets = torch.tensor(list(prompt_ids[1:]), dtype=torch.long)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    if top_n <= 0:
        return chosen, [[] for _ in chosen], [[] for _ in chosen]
    values, indices = torch.topk(logprobs, top_n, dim=-1)
    return chosen, indices.tolist(), values.tolist()
