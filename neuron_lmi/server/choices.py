"""Choice helpers: completions' ``echo`` with prompt log-probabilities, and ``best_of`` (OpenAI and TGI).

With ``echo`` and ``logprobs``, a choice's ``logprobs`` lists the prompt's tokens first (the first
one has ``null`` log-probability and alternatives, as OpenAI's and vLLM's do), then the generated
tokens. ``best_of`` candidates are ranked by their cumulative log-probability (the model's own
distribution, as vLLM ranks them) and the best ``n`` are returned, in that order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from neuron_lmi.engine.types import FinishReason, PromptToken
from neuron_lmi.server.generation import Collected


def prompt_logprobs(prompt: Sequence[PromptToken] | None) -> dict[str, list[Any]]:
    """The echoed prompt's part of a completions ``logprobs`` object (text offsets from 0)."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for i, token in enumerate(prompt or ()):
        out["tokens"].append(token.text)
        out["token_logprobs"].append(token.logprob)
        out["top_logprobs"].append({t.text: t.logprob for t in token.top} if i else None)
        out["text_offset"].append(offset)
        offset += len(token.text)
    return out


def prepend(head: dict[str, list[Any]], tail: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {key: head[key] + tail[key] for key in tail}


def first_prompt(out: Collected) -> tuple[PromptToken, ...] | None:
    """The scored prompt a request's first event carries (None if it was not scored)."""
    return out.events[0].prompt if out.events else None


def prompt_of(out: Collected) -> Collected:
    """``max_tokens: 0``: the request as if it had stopped before its first token (its first event
    keeps the scored prompt, with no text and no token of its own; finish_reason ``length``)."""
    failure = out.failure()
    if failure is not None or not out.events:
        return out
    first = dataclasses.replace(out.events[0], token_id=-1, text="", finish_reason=FinishReason.LENGTH)
    return Collected(events=[first], prompt_tokens=out.prompt_tokens)


def cumulative_logprob(out: Collected) -> float:
    return sum(e.logprob for e in out.tokens)


def best_of(outs: Sequence[Collected], per_prompt: int, n: int) -> list[Collected]:
    """From ``per_prompt`` candidates of each prompt (consecutive in ``outs``), the ``n`` best."""
    chosen: list[Collected] = []
    for start in range(0, len(outs), per_prompt):
        group = outs[start : start + per_prompt]
        chosen += sorted(group, key=cumulative_logprob, reverse=True)[:n]
    return chosen
