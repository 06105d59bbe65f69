"""What a forward's output becomes before the core applies it: one logits row per line, each line's
sampled token (the device's draw, or the host sampler's), a scored prompt, and closing events.

Pure with respect to the engine's state: nothing here touches the scheduler, rows or requests'
status; ``EngineCore`` applies the results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from neuron_lmi.engine.device_sampling import host_field
from neuron_lmi.engine.request import Request
from neuron_lmi.engine.sampling import SampleOutput, prompt_logprobs, sample
from neuron_lmi.engine.types import FinishReason, PromptToken, TokenEvent, TopToken
from neuron_lmi.runners.base import DeviceSampling, StepBatch


@dataclass(frozen=True, slots=True)
class LineSampler:
    """Each line's token: the device's where it drew one (``device``: the runner's on-device
    sampling, ``None`` where it has none), the host sampler's for the other lines.

    Invariant: a line the host samples has logits; a runner that returns none for it is an error
    naming ``runner_name`` (admission refuses the requests that would need them).
    """

    device: DeviceSampling | None
    runner_name: str
    stop_ids: Sequence[int]

    def sample(
        self, logits: torch.Tensor | None, tokens: torch.Tensor | None, requests: list[Request]
    ) -> SampleOutput:
        if self.device is None or tokens is None:
            return self._host(logits, requests)
        host = [i for i, r in enumerate(requests) if host_field(r.params, self.device) is not None]
        n = len(requests)
        out = SampleOutput([int(t) for t in tokens.tolist()], [0.0] * n, [[]] * n, [[]] * n)
        if host:
            rows = logits[host] if logits is not None else None
            part = self._host(rows, [requests[i] for i in host])
            for j, i in enumerate(host):
                out.tokens[i], out.logprobs[i] = part.tokens[j], part.logprobs[j]
                out.top_ids[i], out.top_logprobs[i] = part.top_ids[j], part.top_logprobs[j]
        return out

    def device_runs(
        self, runs: tuple[tuple[int, ...], ...], requests: list[Request]
    ) -> dict[int, tuple[int, ...]]:
        """The lines whose tokens are the device's accepted run: those the device sampled (a line
        the host samples takes one token from the logits of its first position, as without
        speculation: its row keeps that position only)."""
        if self.device is None or len(runs) != len(requests):
            raise RuntimeError(f"{self.runner_name} returned {len(runs)} runs for {len(requests)} lines")
        pairs = enumerate(zip(runs, requests, strict=True))
        return {i: run for i, (run, r) in pairs if host_field(r.params, self.device) is None}

    def _host(self, logits: torch.Tensor | None, requests: list[Request]) -> SampleOutput:
        if logits is None:  # admission refuses such requests (Admission._check_backend): never sampled greedy
            raise RuntimeError(f"{self.runner_name} returned no logits to sample on the host")
        return sample(
            logits,
            [r.params for r in requests],
            [r.all_ids for r in requests],
            [r.generator for r in requests],
            outputs=[r.output_ids for r in requests],
            grammars=[r.grammar for r in requests],
            stop_ids=list(self.stop_ids),
        )


def speculative_lines(
    batch: StepBatch, logits: torch.Tensor | None
) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """A forward's logits as one row per line (each line's last position), and for each speculative
    line (``StepBatch.logit_counts`` above 1) the logits of all its positions."""
    if not batch.logit_counts or logits is None:
        return logits, {}
    ends = list(accumulate(batch.logit_counts))
    counts = enumerate(zip(ends, batch.logit_counts, strict=True))
    spans = {i: logits[end - n : end] for i, (end, n) in counts if n > 1}
    return logits[[end - 1 for end in ends]], spans


def scored_prompt(
    request: Request, prompt_logits: Callable[[list[int]], torch.Tensor]
) -> tuple[PromptToken, ...] | None:
    """The prompt with its log-probabilities, for the first event of a request that asked."""
    top_n = request.params.prompt_logprobs
    if top_n is None or request.output_ids:
        return None
    ids = request.prompt_ids
    chosen, top_ids, top_lps = prompt_logprobs(prompt_logits(ids), ids, top_n)
    rest = (
        PromptToken(t, "", lp, tuple(TopToken(a, "", v) for a, v in zip(ti, tv, strict=True)))
        for t, lp, ti, tv in zip(ids[1:], chosen, top_ids, top_lps, strict=True)
    )
    return (PromptToken(ids[0], "", None), *rest)


def closing_event(request: Request, reason: FinishReason, error: str | None = None) -> TokenEvent:
    """The last event of a request that ends without a token (abort, error): ``token_id == -1``."""
    return TokenEvent(
        request_id=request.request_id,
        index=len(request.output_ids),
        token_id=-1,
        token_text="",
        text="",
        logprob=0.0,
        special=False,
        prompt_tokens=len(request.prompt_ids),
        finish_reason=reason,
        error=error,
    )
