"""Speculative decoding: proposal (n-gram lookup or a draft model), verification, back-off, counters.

One decode step of a row with a draft::

    Scheduler.schedule    Speculator.drafts(rows): how many tokens each row may draft (the cost cap,
                          the back-off, its room), then its ``Proposer``'s drafts for them all:
                          NgramProposer, up to k tokens that followed the earliest earlier
                          occurrence of the row's longest suffix n-gram (prompt_lookup_min..max
                          long), searched over prompt + output, as vLLM's NgramProposer does; or
                          DraftModelProposer (``engine.draft_model``), k tokens of a small model
    Scheduler._batches    the decode as one EXTEND line [last token, d1..dk] from the row's length,
                          wanting the logits of all k + 1 positions (StepBatch.logit_counts)
    runner.forward        writes the k + 1 positions' K/V, returns their logits
    EngineCore            verify(): the accepted drafts and one token of the model's (the correction
                          at the first rejection, or the bonus token after k acceptances); the row is
                          cut back to what was accepted (RowTable.set_length), then each token goes
                          through the usual accept (EOS, stop ids, max_new_tokens cut it exactly)

Verification keeps the model's distribution. Greedy: a draft is accepted while it equals the argmax
at its position, so greedy output is the output without speculation. Sampled: the speculative-sampling
rule (Leviathan et al., Chen et al. 2023) accepts draft d with probability min(1, p(d) / q(d)); on
rejection it draws from the residual max(0, p - q) renormalised; after k acceptances it draws the
bonus token from p. A draft model's q is its own sampling distribution at each position (the
request's temperature and filters on the draft's logits, d drawn from it). A prompt lookup's q is a
point mass delta(d), where the rule reads: accept d with probability p(d); on rejection draw from p
with d removed and renormalised. ``p`` is
the host sampler's distribution (temperature, min_p, top_k, top_p applied), drawn with the request's
own generator, so a seed reproduces a run (not the same tokens as without speculation: the generator
is consumed differently).

Which rows speculate (``speculates``): a request whose sampling is a pure function of the logits at
each position. Requests with a grammar, repetition/presence/frequency penalties, logit_bias,
top_n_tokens (alternatives per token), or still inside ``min_tokens`` decode one token per step;
their logits at later positions would depend on tokens not yet accepted.

Back-off (per request): a draft with nothing accepted is a miss; after ``MISSES_BEFORE_PAUSE``
misses in a row the request proposes nothing for ``PAUSE_STEPS`` decode steps (the verification
costs a longer forward), then tries again. A row where the lookup finds no match costs nothing.

Cost (``DraftCost``): a draft token is worth its forward time only while it is likely enough to be
emitted. The engine feeds every forward's tokens and seconds to a line ``t(T) = a + b T`` fitted
online; at a step decoding ``B`` rows an emitted token is worth ``t(B) / B`` and a draft token costs
``b``, and the ``j``-th draft of a row whose drafts are each accepted with probability ``alpha`` is
emitted with probability ``alpha ** j``. So a row drafts at most ``j`` tokens with ``alpha ** j >
b B / t(B)``: everything at batch 1, where a forward reads the weights whatever it computes; little
at a large batch whose forward grows with every token, unless the row's drafts keep being accepted.
``alpha`` is the row's own recent acceptance (accepted drafts over accepted drafts and rejections,
with a prior of ``PRIOR_ACCEPTANCE``). A row that drafts nothing forgets its history a little each
step, so it tries again later. The cap depends on timing, so it applies only to rows whose output
it cannot change: greedy ones and those without a seed (a seeded sampled row drafts what the lookup
finds, so the seed reproduces its tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from neuron_lmi.config.speculative import DRAFT_MODEL, NGRAM, SpeculativeConfig
from neuron_lmi.engine.request import Request
from neuron_lmi.engine.sampling import filter_logits, greedy_argmax
from neuron_lmi.engine.types import SamplingParams
from neuron_lmi.models.token_draw import draw_from_logits
from neuron_lmi.runners.base import RunnerCapabilities

MISSES_BEFORE_PAUSE = 3
PAUSE_STEPS = 16
NEG_INF = float("-inf")
COST_DECAY = 0.98  # weight of each older forward in the cost line: about the last 50 count
ACCEPTANCE_DECAY = 0.8  # weight of each older verify (and idle step) in a row's acceptance
PRIOR_ACCEPTANCE = 0.8  # a row's acceptance before it has verified anything, worth one verify
MIN_TOKEN_SPREAD = 1.0  # the forwards' token counts must vary this much (variance) to fit a slope


def check_speculation(
    config: SpeculativeConfig, capabilities: RunnerCapabilities, runner: str, has_draft: bool = False
) -> None:
    """Refuse at start-up what this engine and runner cannot run, naming the key. ``has_draft``:
    the backend built the draft model's runner (``draft_model`` needs one)."""
    key = config.key
    if config.method not in (NGRAM, DRAFT_MODEL) or (config.method == DRAFT_MODEL and not has_draft):
        raise ValueError(
            f"{key}: method {config.method!r} is not supported yet on this backend ({runner}); "
            f'use {{"method": "ngram", ...}}'
        )
    if capabilities.device_sampling is not None:
        raise ValueError(f"{key}: {runner} samples on the device, which cannot verify draft tokens")
    need = config.num_speculative_tokens + 1
    if verify_tokens(capabilities) < need:
        can = verify_tokens(capabilities)
        reason = "cannot verify several tokens in one forward" if can < 2 else f"verifies at most {can - 1}"
        raise ValueError(f"{key}: num_speculative_tokens={need - 1}, but {runner} {reason}")


# The methods a device fuses into its token-generation graph (NxD Inference: a draft model, or an
# EAGLE head over the target's hidden states); the engine then proposes nothing itself.
FUSED_METHODS = frozenset({"draft_model", "eagle", "eagle3"})


def check_fused_speculation(config: SpeculativeConfig, capabilities: RunnerCapabilities, runner: str) -> None:
    """Refuse at start-up a setting the runner's fused speculation does not run, naming the key."""
    key = config.key
    if config.method not in FUSED_METHODS:
        raise ValueError(
            f"{key}: method {config.method!r}: {runner} drafts on the device (a draft model or an "
            f"EAGLE head compiled into its graph); use one of {', '.join(sorted(FUSED_METHODS))}"
        )
    if capabilities.fused_speculation != config.num_speculative_tokens + 1:
        raise ValueError(
            f"{key}: num_speculative_tokens={config.num_speculative_tokens}, but {runner} was built "
            f"to emit up to {capabilities.fused_speculation} tokens per step"
        )


def verify_tokens(capabilities: RunnerCapabilities) -> int:
    """The longest verify line (``[last token, d1..dk]``) one forward takes: within both the
    positions whose logits it returns (``max_verify_tokens``) and its longest line
    (``max_chunk_tokens``)."""
    longest = capabilities.max_chunk_tokens
    can = capabilities.max_verify_tokens
    return can if longest is None else min(can, longest)


def propose_ngram(ids: Sequence[int], k: int, low: int, high: int) -> list[int]:
    """Up to ``k`` tokens that followed the earliest earlier occurrence of the longest suffix of
    ``ids`` of ``low .. high`` tokens (vLLM's prompt lookup); empty when none occurs."""
    total = len(ids)
    if k < 1 or total <= low:
        return []
    tokens = torch.tensor(list(ids), dtype=torch.long)
    before = tokens[:-1]  # an occurrence ends before the last token, so one token at least follows it
    for n in range(min(high, total - 1), low - 1, -1):
        hits = (before.unfold(0, n, 1) == tokens[-n:]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[0]) + n
            return [int(t) for t in ids[start : start + k]]
    return []


def speculates(params: SamplingParams, generated: int) -> bool:
    """Whether a request's next tokens may be drafted (see the module docstring)."""
    return not (
        params.grammar is not None
        or params.repetition_penalty != 1.0
        or params.presence_penalty
        or params.frequency_penalty
        or params.logit_bias
        or params.top_n_tokens
        or generated < params.min_tokens
    )


def sampling_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits the host sampler draws a speculating request's token from, ``[n, vocab]``:
    temperature, then min_p, top_k and top_p (``sampling.sample``'s pipeline for such a row)."""
    n = logits.shape[0]
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    return filter_logits(
        scaled,
        torch.full((n,), params.top_k),
        torch.full((n,), params.top_p),
        torch.full((n,), params.min_p),
    )


def rejection_sample(
    logits: torch.Tensor,
    drafts: Sequence[int],
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """Speculative sampling. ``logits`` ``[len(drafts) + 1, vocab]`` are the sampling logits
    (``sampling_logits``) at each draft's position and the one after; ``draft_probs``
    ``[len(drafts), vocab]`` the distribution q each draft was drawn from (None: point masses, a
    prompt lookup's). Returns the accepted drafts and one more token: the correction drawn from
    max(0, p - q) at the first rejection, or the bonus from the last position."""
    probs = torch.softmax(logits, dim=-1)
    out: list[int] = []
    for j, draft in enumerate(drafts):
        p = float(probs[j, draft])
        q = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        if q <= 0.0 or float(torch.rand((), generator=generator)) < p / q:  # q(d) = 0: never drawn
            out.append(int(draft))
            continue
        if draft_probs is None:  # max(0, p - delta(d)) is p without d
            residual = logits[j].clone()
            residual[draft] = NEG_INF
        else:
            mass = (probs[j] - draft_probs[j]).clamp_(min=0.0)
            # p == q up to rounding (a draft of the target itself) leaves no mass: p is then the residual.
            residual = mass.log() if float(mass.sum()) > 0.0 else logits[j]
        out.append(int(draw_from_logits(residual[None], [generator])[0]))
        return out
    out.append(int(draw_from_logits(logits[-1:], [generator])[0]))
    return out


def verify(
    logits: torch.Tensor, drafts: Sequence[int], request: Request, draft_probs: torch.Tensor | None = None
) -> list[int]:
    """The tokens a verified line emits, from the raw logits of its ``len(drafts) + 1`` positions;
    ``draft_probs``: the draft model's q of each draft (None: point masses)."""
    params = request.params
    if params.greedy:
        targets = greedy_argmax(logits).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        return [*drafts[:accepted], targets[accepted]]
    return rejection_sample(sampling_logits(logits, params), drafts, request.generator, draft_probs)


@dataclass(frozen=True, slots=True)
class Draft:
    """A row's proposal: ``tokens`` (up to the room it was given), and ``probs`` ``[len(tokens),
    vocab]``, the distribution each was drawn from where it was sampled (None: point masses, as a
    lookup's or a greedy draft's)."""

    tokens: tuple[int, ...] = ()
    probs: torch.Tensor | None = None


NO_DRAFT = Draft()


class Proposer(Protocol):
    """Where drafts come from: ``propose`` gives each request a ``Draft`` of at most ``rooms[i]``
    tokens (each room >= 1), all requests in one call (a draft model batches its forwards over
    them); ``release`` forgets a finished request (a draft model frees its row)."""

    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[Draft]: ...

    def release(self, request: Request) -> None: ...

    def token_seconds(self, rows: int) -> float:
        """What proposing one draft token of one row costs, in seconds, at a step of ``rows``
        rows (the cost cap adds it to the verify's cost of the token)."""
        ...


@dataclass(frozen=True, slots=True)
class NgramProposer:
    """vLLM's prompt lookup (``propose_ngram``) over each request's prompt + output."""

    low: int
    high: int

    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[Draft]:
        return [
            Draft(tuple(propose_ngram(r.all_ids, room, self.low, self.high)))
            for r, room in zip(requests, rooms, strict=True)
        ]

    def release(self, request: Request) -> None:
        pass

    def token_seconds(self, rows: int) -> float:
        return 0.0  # a lookup costs next to nothing beside a forward


@dataclass(slots=True)
class DraftCost:
    """The runner's forward time against the tokens it computes, as a line ``a + b T`` fitted by
    least squares over recent forwards (``observe``), older ones weighted down by ``COST_DECAY``."""

    weight: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    tokens_sq: float = 0.0
    tokens_seconds: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = COST_DECAY
        self.weight = self.weight * d + 1.0
        self.tokens = self.tokens * d + tokens
        self.seconds = self.seconds * d + seconds
        self.tokens_sq = self.tokens_sq * d + tokens * tokens
        self.tokens_seconds = self.tokens_seconds * d + tokens * seconds

    def line(self) -> tuple[float, float] | None:
        """``(a, b)``: seconds per forward (above 0) and per token (at least 0); None until the
        forwards seen differ enough in size to give a slope, and while the fit puts no time on a
        forward of nothing. Every forward has a fixed cost (its weights are read once), so an
        intercept at or below 0 is timing noise over few sizes, and clamping it to 0 would make
        every draft look unpaid (``break_even`` 1)."""
        w = self.weight
        if w < 2.0:
            return None
        mean_t, mean_s = self.tokens / w, self.seconds / w
        spread = self.tokens_sq / w - mean_t * mean_t
        if spread < MIN_TOKEN_SPREAD:
            return None
        slope = max((self.tokens_seconds / w - mean_t * mean_s) / spread, 0.0)
        intercept = mean_s - slope * mean_t
        return (intercept, slope) if intercept > 0.0 else None

    def break_even(self, rows: int, proposing: float = 0.0) -> float | None:
        """``(b + c) B / t(B)`` at ``B = rows``: the probability of being emitted above which a draft
        token pays for itself in a step decoding ``rows`` rows, where ``c = proposing`` is what
        proposing it costs (a draft model's forward share; 0 for a lookup). None: no line yet."""
        line = self.line()
        if line is None:
            return None
        a, b = line
        total = a + b * rows
        return (b + proposing) * rows / total if total > 0 else None


def acceptance(request: Request) -> float:
    """The row's chance that its next draft token is accepted (``PRIOR_ACCEPTANCE`` worth one
    verify, then its own recent verifies)."""
    accepted, rejected = request.spec_accepted, request.spec_rejected
    return (accepted + PRIOR_ACCEPTANCE) / (accepted + rejected + 1.0)


def worth_drafting(request: Request, break_even: float | None, most: int) -> int:
    """How many draft tokens pay for their forward time: the largest ``j <= most`` with
    ``acceptance ** j > break_even`` (all ``most`` without a cost line)."""
    if break_even is None or break_even <= 0.0:
        return most
    if break_even >= 1.0:
        return 0
    alpha = acceptance(request)
    if alpha >= 1.0:
        return most
    return min(most, max(0, math.ceil(math.log(break_even) / math.log(alpha)) - 1))


@dataclass(slots=True)
class SpecCounters:
    """vLLM's spec_decode counters (``vllm:spec_decode_num_*``), totals since start."""

    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.k

    def observe(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1

    def extra(self) -> dict[str, float]:
        """``EngineStats.extra`` entries; ``server.metrics`` turns them into vLLM's counters."""
        out = {
            "spec_decode_num_drafts": float(self.drafts),
            "spec_decode_num_draft_tokens": float(self.draft_tokens),
            "spec_decode_num_accepted_tokens": float(self.accepted_tokens),
        }
        for pos, n in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_per_pos.{pos}"] = float(n)
        return out


class Speculator:
    """Drafts for decoding rows (``drafts``) and what became of them (``verify``, ``observe``): the
    proposer (n-gram lookup unless one is given), the per-request back-off and the counters.

    Invariants: a draft is never longer than ``num_speculative_tokens``, than the runner verifies in
    one forward (``max_verify_tokens - 1``: the engine gives ``verify_tokens(capabilities)``), than
    the row has positions left for, or than the request may still generate minus one (the model's
    own token always follows the drafts). The q of a step's sampled drafts is held from ``drafts``
    until the next step's (or the request's ``release``).
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        max_verify_tokens: int,
        n_positions: int,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.max_draft = min(config.num_speculative_tokens, max_verify_tokens - 1)
        self.n_positions = n_positions
        self.proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.counters = SpecCounters(config.num_speculative_tokens)
        self.cost = DraftCost()
        self._probs: dict[Request, torch.Tensor] = {}

    def drafts(self, decoding: Sequence[Request]) -> dict[Request, tuple[int, ...]]:
        """The drafts of a step's decoding rows (those with one), the cost line read once and the
        proposer asked once for them all."""
        rows = len(decoding)
        return self._propose(decoding, self.cost.break_even(rows, self.proposer.token_seconds(rows)))

    def draft(self, request: Request, break_even: float | None = None) -> tuple[int, ...]:
        """The draft for ``request``'s next decode step alone (empty: decode one token);
        ``break_even`` is the step's ``DraftCost.break_even`` (None: no cap)."""
        return self._propose([request], break_even).get(request, ())

    def _propose(
        self, decoding: Sequence[Request], break_even: float | None
    ) -> dict[Request, tuple[int, ...]]:
        self._probs.clear()  # the last step's drafts are verified (or their requests gone)
        rooms = {r: room for r in decoding if (room := self.room(r, break_even)) > 0}
        if not rooms:
            return {}
        out: dict[Request, tuple[int, ...]] = {}
        proposals = self.proposer.propose(list(rooms), list(rooms.values()))
        for request, draft in zip(rooms, proposals, strict=True):
            if draft.tokens:
                out[request] = draft.tokens
                if draft.probs is not None:
                    self._probs[request] = draft.probs
        return out

    def room(self, request: Request, break_even: float | None = None) -> int:
        """How many tokens ``request`` may draft this step (0: none), the back-off and the cost cap
        applied."""
        params = request.params
        if not speculates(params, len(request.output_ids)):
            return 0
        if request.spec_pause:
            request.spec_pause -= 1
            return 0
        room = min(
            self.max_draft,
            self.n_positions - len(request.prompt_ids) - len(request.output_ids),
            params.max_new_tokens - len(request.output_ids) - 1,
        )
        if params.greedy or params.seed is None:  # the cap cannot change such a row's tokens
            room = worth_drafting(request, break_even, room)
            if room < 1:
                request.spec_accepted *= ACCEPTANCE_DECAY  # drift back towards the prior
                request.spec_rejected *= ACCEPTANCE_DECAY
                return 0
        return max(room, 0)

    def verify(self, logits: torch.Tensor, drafts: Sequence[int], request: Request) -> list[int]:
        """``verify`` with the q this step's proposer drew ``request``'s drafts from (kept until the
        next step's drafts: a failed batch's lines are verified again one by one)."""
        return verify(logits, drafts, request, self._probs.get(request))

    def release(self, request: Request) -> None:
        """Forget a finished request (its draft row, its pending q)."""
        self._probs.pop(request, None)
        self.proposer.release(request)

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """One runner forward of ``tokens`` tokens took ``seconds`` (the cost line)."""
        self.cost.observe(tokens, seconds)

    def observe(self, request: Request, drafted: int, accepted: int) -> None:
        """Count a verified draft and update the request's acceptance and back-off."""
        self.counters.observe(drafted, accepted)
        request.spec_accepted = request.spec_accepted * ACCEPTANCE_DECAY + accepted
        request.spec_rejected = request.spec_rejected * ACCEPTANCE_DECAY + (accepted < drafted)
        if accepted:
            request.spec_misses = 0
            return
        request.spec_misses += 1
        if request.spec_misses >= MISSES_BEFORE_PAUSE:
            request.spec_misses, request.spec_pause = 0, PAUSE_STEPS
