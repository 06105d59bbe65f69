"""Draft-model speculation: a second, small model of the same vocabulary proposes each row's draft.

The draft model has its own runner (the CPU backend's eager ``CpuRunner``) and so its own KV cache,
with as many rows as the target's. A request's draft row is the row of the same index as its target
row: taken on its first draft, freed when the target's row is (``release``, from
``Scheduler.finish``), so a target row in use never finds its draft row held by another request::

    target row 3   [p0 p1 .. pn-1]                 n - 1 positions: the newest id is not in yet
    draft  row 3   [p0 p1 .. pn-1 d1 .. dk-1]      after proposing d1 .. dk (dk is never written)

One ``propose`` for a step's drafting rows, all rows in each forward:

1. each draft row is cut back (``RowTable.set_length``, as the target's row is after a rejection)
   to the longest prefix of what it holds that is still the request's ids (the prompt and output;
   the drafts the target rejected go), then caught up with the ids after it: one EXTEND batch of
   every row's missing ids (the whole prompt on a row's first draft; a chunk at most
   ``max_chunk_tokens`` long per forward), whose last logits give each row's first draft token;
2. then one DECODE batch per further position, of the rows that may draft that far.

A greedy request's draft is the draft model's argmax at each position; a sampled one's is drawn with
the request's own generator from the draft's sampling distribution q (the request's temperature and
filters on the draft's logits), and q goes with it to the rejection sampler
(``speculation.rejection_sample``), so output keeps the target's distribution either way. Prefix
reuse and chunked prefill touch the target's rows only: a draft row computes what it lacks itself,
from a prefix it retained when its previous request finished, where that prefix is the new
request's too. A draft forward that fails costs its step the drafts (the rows decode one token) and
the draft rows their contents (computed again on the next draft), never the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from neuron_lmi.engine.request import Request
from neuron_lmi.engine.sampling import greedy_argmax
from neuron_lmi.engine.speculation import Draft, sampling_logits
from neuron_lmi.models.token_draw import draw_from_logits
from neuron_lmi.runners.base import BatchKind, ModelRunner, StepBatch, capabilities_of

log = logging.getLogger(__name__)

SECONDS_DECAY = 0.9  # weight of each older draft forward in the cost of a draft token


@dataclass(slots=True)
class DraftRow:
    """A request's row in the draft cache and the ids whose K/V it holds, in order (a prefix of the
    request's ids, then the last step's drafts until they are verified)."""

    row: int
    held: list[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelProposer:
    """The ``speculation.Proposer`` of a draft model (see the module docstring).

    Invariants: ``runner.rows`` holds one row per request with a ``DraftRow``, of the request's
    target row index, whose length is ``len(held)``; a freed draft row retains only positions that
    ``_retained`` lists the ids of.
    """

    def __init__(self, runner: ModelRunner, vocab_size: int, n_rows: int, n_positions: int, key: str) -> None:
        capabilities = capabilities_of(runner)
        name = type(runner).__name__
        if not capabilities.extend:
            raise ValueError(f"{key}: the draft model's runner ({name}) cannot extend its rows")
        if runner.rows.n_rows < n_rows or runner.n_positions < n_positions:
            raise ValueError(
                f"{key}: the draft model's cache ({runner.rows.n_rows} rows x {runner.n_positions} positions)"
                f" is smaller than the target's ({n_rows} x {n_positions})"
            )
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: q and the drafts are over its ids
        self.max_chunk = capabilities.max_chunk_tokens
        self._rows: dict[Request, DraftRow] = {}
        self._retained: dict[int, list[int]] = {}  # a freed draft row -> the ids it retains
        self._token_seconds = 0.0  # a draft token's share of a DECODE forward, recent ones weighted up

    # -- Proposer -----------------------------------------------------------------------------
    def propose(self, requests: Sequence[Request], rooms: Sequence[int]) -> list[Draft]:
        try:
            return self._propose(list(requests), list(rooms))
        except Exception:  # the step goes on without drafts; the draft rows are computed again
            log.exception("the draft model failed for %d row(s); decoding them without drafts", len(requests))
            for request in requests:
                if (draft := self._rows.get(request)) is not None:
                    self.runner.rows.set_length(draft.row, 0)
                    draft.held = []
            return [Draft() for _ in requests]

    def release(self, request: Request) -> None:
        draft = self._rows.pop(request, None)
        if draft is None:
            return
        keep = common_prefix(draft.held, request.all_ids)
        self.runner.rows.remove(draft.row, keep)
        if keep:
            self._retained[draft.row] = draft.held[:keep]

    def token_seconds(self, rows: int) -> float:
        return self._token_seconds

    # -- one proposal -------------------------------------------------------------------------
    def _propose(self, requests: list[Request], rooms: list[int]) -> list[Draft]:
        rows = [self._row_of(r) for r in requests]
        logits = self._catch_up(requests, rows)
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        while True:
            for i, token, q in zip(active, *self._choose(logits, [requests[i] for i in active]), strict=True):
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(tokens[i]) < rooms[i]]
            if not active:
                break
            logits = self._decode([rows[i] for i in active], [tokens[i][-1] for i in active])
        return [Draft(tuple(t), torch.stack(q) if q else None) for t, q in zip(tokens, probs, strict=True)]

    def _row_of(self, request: Request) -> DraftRow:
        """The request's draft row, taken now on its first draft (with what the freed row retains of
        the request's ids), cut back to the longest prefix of the request's ids it holds."""
        ids = request.all_ids
        table = self.runner.rows
        draft = self._rows.get(request)
        if draft is None:
            if request.row is None:
                raise RuntimeError(f"request {request.request_id} drafts without a target row")
            retained = self._retained.pop(request.row, [])
            keep = min(common_prefix(retained, ids), table.retained(request.row))
            table.allocate(request.row, keep=keep)
            draft = self._rows[request] = DraftRow(request.row, retained[:keep])
        # The newest id always goes in again: its logits give the first draft token.
        keep = min(common_prefix(draft.held, ids), len(ids) - 1)
        if keep < len(draft.held):
            table.set_length(draft.row, keep)
            del draft.held[keep:]
        return draft

    def _catch_up(self, requests: list[Request], rows: list[DraftRow]) -> torch.Tensor:
        """Write each row's missing ids (EXTEND batches of chunks up to ``max_chunk``); the logits
        at each row's newest id, ``[len(rows), vocab]``."""
        missing = [r.all_ids[len(d.held) :] for r, d in zip(requests, rows, strict=True)]
        out = torch.empty(len(rows), self.vocab_size)
        while lines := [i for i, ids in enumerate(missing) if ids]:
            step = self.max_chunk or max(len(missing[i]) for i in lines)
            chunks = [missing[i][:step] for i in lines]
            batch = StepBatch(
                BatchKind.EXTEND,
                tuple(rows[i].row for i in lines),
                tuple(len(rows[i].held) for i in lines),
                tuple(chunks),
                (True,) * len(lines),
            )
            logits = self._fit(self.runner.forward(batch))
            for j, (i, chunk) in enumerate(zip(lines, chunks, strict=True)):
                rows[i].held += chunk
                missing[i] = missing[i][len(chunk) :]
                if not missing[i]:
                    out[i] = logits[j]
        return out

    def _decode(self, rows: list[DraftRow], tokens: list[int]) -> torch.Tensor:
        """One DECODE forward: ``tokens[i]`` written into ``rows[i]``; their next logits."""
        batch = StepBatch(
            BatchKind.DECODE,
            tuple(d.row for d in rows),
            tuple(len(d.held) for d in rows),
            tuple((t,) for t in tokens),
            (True,) * len(rows),
            len(rows),
        )
        began = time.perf_counter()
        logits = self._fit(self.runner.forward(batch))
        seconds = (time.perf_counter() - began) / len(rows)
        self._token_seconds = self._token_seconds * SECONDS_DECAY + seconds * (1.0 - SECONDS_DECAY)
        for draft, token in zip(rows, tokens, strict=True):
            draft.held.append(token)
        return logits

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's ids (its vocabulary as a prefix of the target's: the
        engine checked their tokenizers agree); ids only one model has are never drafted."""
        vocab = logits.shape[-1]
        if vocab == self.vocab_size:
            return logits
        if vocab > self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = torch.full((logits.shape[0], self.vocab_size - vocab), float("-inf"), dtype=logits.dtype)
        return torch.cat([logits, pad], dim=1)

    def _choose(
        self, logits: torch.Tensor, requests: list[Request]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each row's next draft token: the argmax for a greedy request; drawn from q (returned with
        it) with the request's generator for a sampled one."""
        tokens = greedy_argmax(logits).tolist()
        probs: list[torch.Tensor | None] = [None] * len(requests)
        for i, request in enumerate(requests):
            if request.params.greedy:
                continue
            filtered = sampling_logits(logits[i : i + 1], request.params)
            probs[i] = torch.softmax(filtered, dim=-1)[0]
            tokens[i] = int(draw_from_logits(filtered, [request.generator])[0])
        return tokens, probs
