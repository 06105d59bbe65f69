"""The rolling-batch decision for one step, and the rows and batches that carry it out.

``Scheduler.schedule`` decides: which prompt tokens are computed, who decodes (``SchedulerOutput``).
``Scheduler.next_step`` then owns the rows: it places admitted requests (allocating, claiming a
retained prefix, naming the copies a live prefix needs) and cuts the step into ``StepBatch``es as
the runner's ``RunnerCapabilities`` allow (``StepPlan``). The engine runs the plan and applies the
tokens; ``Scheduler.finish`` releases a row, retaining its prefix. Two small policy objects keep
``schedule`` free of feature branches:

* ``PrefillPolicy`` — how many prompt tokens a step computes: ``WholePrompts`` (every prompt in
  one piece, within a prefill budget) or ``ChunkedPrefill`` (one budget shared with the running
  decodes; prompts are split into chunks, so a burst of long prompts never freezes the streams);
* ``PrefixIndex`` (``engine.prefix``) — which cached prefix a new prompt can start from;
* ``AdapterTable`` (``engine.lora``) — the runner's LoRA slots: a request with an adapter is
  admitted once its adapter has a slot (``pin``), and each batch carries its lines' slots;
* ``Speculator`` (``engine.speculation``) — which draft tokens a decoding row verifies this step
  (speculative decoding: the decode becomes the verify line ``[last token, d1..dk]``). Its proposer
  may run a draft model (``engine.draft_model``, on its own runner and rows); the scheduler only
  sees the tokens, and frees a request's draft row with its row (``finish``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Protocol

from cache_api import RowTable
from neuron_lmi.engine.lora import AdapterTable
from neuron_lmi.engine.prefix import PrefixHit, PrefixIndex
from neuron_lmi.engine.request import Request, Status
from neuron_lmi.engine.speculation import Speculator
from neuron_lmi.runners.base import BatchKind, RunnerCapabilities, StepBatch

# Tokens one step takes (decodes + prompt chunks) under ChunkedPrefill. 512 against 256 and 1,024, on
# 1,000-token prompts beside 16 streams: the most generated and prompt tokens/s and the lowest TTFT
# in bf16 and fp32, at a bounded inter-token latency p99 (docs/benchmarks.md).
DEFAULT_STEP_TOKENS = 512
DEFAULT_MIN_CHUNK = 32


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """Prompt positions ``start .. end - 1`` of ``request``, computed this step.

    ``source`` is set on a newly placed request's first chunk when its first ``start`` positions
    come from another row (prefix reuse); otherwise a chunk with ``start > 0`` continues what the
    request's own row holds.
    """

    request: Request
    start: int
    end: int
    source: PrefixHit | None = None

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids[self.start : self.end]

    @property
    def final(self) -> bool:
        return self.end == len(self.request.prompt_ids)


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """``prefill``: new requests to place into free rows. ``chunks``: prompt spans computed this step
    (new requests' first chunks included); a final chunk yields the request's first token.
    ``decode``: running requests that get one token this step, or with a draft in ``drafts`` up to
    ``len(draft) + 1`` (speculative decoding). New rows are inserted while the others keep decoding
    (the KV-row API); nothing already in a row is computed again."""

    prefill: list[Request] = field(default_factory=list)
    chunks: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)
    drafts: dict[Request, tuple[int, ...]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.chunks or self.decode)


@dataclass(slots=True)
class StepPlan:
    """A step as the engine runs it: ``failed`` placements end their requests; ``copies`` (request,
    live source) fill a placed row with its source's prefix before any batch; then ``batches`` in
    order, each with the requests of its lines."""

    decision: SchedulerOutput
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    copies: list[tuple[Request, PrefixHit]] = field(default_factory=list)
    batches: list[tuple[StepBatch, list[Request]]] = field(default_factory=list)


class PrefillPolicy(Protocol):
    splits: bool  # whether prompts may be split (the runner must then support ``extend``)

    def budget(self, n_decode: int) -> int:
        """Prompt tokens this step may compute, given how many rows decode."""
        ...

    def take(self, remaining: int, budget: int, first: bool) -> int:
        """How many of a prompt's ``remaining`` tokens to compute now (0: none this step)."""
        ...


@dataclass(frozen=True, slots=True)
class WholePrompts:
    """Whole prompts within ``max_tokens`` per step; the first always goes, however long."""

    max_tokens: int
    splits: bool = False

    def budget(self, n_decode: int) -> int:
        return self.max_tokens

    def take(self, remaining: int, budget: int, first: bool) -> int:
        return remaining if first or remaining <= budget else 0


@dataclass(frozen=True, slots=True)
class ChunkedPrefill:
    """One budget of ``step_tokens`` per step: each decoding row costs one token and prompt chunks
    get the rest, never less than ``min_chunk`` (so prefill progresses under any decode load). A
    chunk shorter than ``min_chunk`` is cut only when it finishes its prompt."""

    step_tokens: int = DEFAULT_STEP_TOKENS
    min_chunk: int = DEFAULT_MIN_CHUNK
    splits: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_chunk <= self.step_tokens:
            raise ValueError(f"need 1 <= min_chunk ({self.min_chunk}) <= step_tokens ({self.step_tokens})")

    def budget(self, n_decode: int) -> int:
        return max(self.step_tokens - n_decode, self.min_chunk)

    def take(self, remaining: int, budget: int, first: bool) -> int:
        n = min(remaining, budget)
        return n if n == remaining or n >= self.min_chunk else 0


class Scheduler:
    """FCFS: running requests' remaining prompt chunks first, then admission into free rows, within
    the prefill policy's budget (``WholePrompts(max_prefill_tokens)`` unless another is given).

    Invariants: a request is in exactly one of ``waiting`` and ``running`` until it finishes; at
    least one prompt makes progress whenever one is pending and a row is free; a request decodes
    only once its whole prompt is in its row. ``schedule`` advances ``Request.prefilled`` to the end
    of each planned chunk (the engine fails a request whose step fails). With ``rows`` (the
    runner's table) it also owns placement and release: a RUNNING request holds one row. With a
    ``speculator``, a decoding row may verify a draft; its tokens count against the step's budget.
    """

    def __init__(
        self,
        max_prefill_tokens: int,
        prefill: PrefillPolicy | None = None,
        prefix: PrefixIndex | None = None,
        rows: RowTable | None = None,
        capabilities: RunnerCapabilities | None = None,
        adapters: AdapterTable | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        if max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill = prefill or WholePrompts(max_prefill_tokens)
        self.prefix = prefix
        self.rows = rows
        self.capabilities = capabilities or RunnerCapabilities()
        self.adapters = adapters
        self.speculator = speculator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._failed: list[tuple[Request, Exception]] = []  # refused while admitting (an adapter's read)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, free_rows: int) -> SchedulerOutput:
        decoding = [r for r in self.running if r.prompt_done]
        drafts = self._drafts(decoding)
        budget = self.prefill.budget(len(decoding) + sum(map(len, drafts.values())))
        chunks: list[PrefillChunk] = []
        for request in self.running:
            if request.prompt_done:
                continue
            n = self._take(len(request.prompt_ids) - request.prefilled, budget, first=not chunks)
            if n == 0:
                break
            chunks.append(PrefillChunk(request, request.prefilled, request.prefilled + n))
            budget -= n
        admitted = self._admit(free_rows, budget, chunks)
        decision = SchedulerOutput(prefill=admitted, chunks=chunks, decode=decoding, drafts=drafts)
        for chunk in chunks:
            chunk.request.prefilled = chunk.end
        for request in admitted:
            request.status = Status.RUNNING
            self.running.append(request)
        return decision

    def _drafts(self, decoding: list[Request]) -> dict[Request, tuple[int, ...]]:
        speculator = self.speculator
        if speculator is None:
            return {}
        return speculator.drafts(decoding)

    def _admit(self, free_rows: int, budget: int, chunks: list[PrefillChunk]) -> list[Request]:
        admitted: list[Request] = []
        claimed: set[int] = set()  # retained rows already taken over this step
        while self.waiting and len(admitted) < free_rows:
            request = self.waiting[0]
            hit = None
            if self.prefix is not None:
                hit = self.prefix.match(request.prompt_ids, self.running, claimed, request.adapter_id)
            start = hit.length if hit else 0
            n = self._take(len(request.prompt_ids) - start, budget, first=not chunks)
            if n == 0:
                break
            if request.adapter_id is not None and self.adapters is not None:
                try:
                    request.lora_slot = self.adapters.pin(request.adapter_id)
                except Exception as exc:  # its adapter could not be read again: this request fails
                    self.waiting.popleft()
                    self._failed.append((request, exc))
                    continue
                if request.lora_slot is None:  # every slot runs other adapters: wait, in order
                    break
            self.waiting.popleft()
            if hit is not None and hit.retained:
                claimed.add(hit.row)
            admitted.append(request)
            chunks.append(PrefillChunk(request, start, start + n, hit))
            budget -= n
        return admitted

    def _take(self, remaining: int, budget: int, first: bool) -> int:
        """The policy's chunk, within the longest line one forward takes (a longer prompt goes on
        in the next steps' chunks)."""
        n = self.prefill.take(remaining, budget, first)
        longest = self.capabilities.max_chunk_tokens
        return n if longest is None else min(n, longest)

    # -- rows and batches ---------------------------------------------------------------------
    def next_step(self) -> StepPlan:
        """Decide the step (``schedule``), place its new requests and cut it into batches."""
        rows = self._table()
        plan = StepPlan(self.schedule(rows.occupancy().rows_free))
        plan.failed, self._failed = self._failed, []
        self._place(plan)
        placed = [c for c in plan.decision.chunks if c.request.row is not None]
        plan.batches = self._batches(placed, plan.decision)
        if self.adapters is not None:  # only an engine serving adapters looks at them
            plan.batches = [(with_adapters(batch, requests), requests) for batch, requests in plan.batches]
        return plan

    def _table(self) -> RowTable:
        if self.rows is None:
            raise RuntimeError("this scheduler was built without rows: it decides, but places nothing")
        return self.rows

    def _place(self, plan: StepPlan) -> None:
        """Give each admitted request a row: a retained source row is claimed whole (first, so no
        other allocation takes it); a live source's prefix is copied into a fresh row."""
        rows = self._table()
        hits = {c.request: c.source for c in plan.decision.chunks if c.source is not None}
        claims_first = sorted(plan.decision.prefill, key=lambda r: not (r in hits and hits[r].retained))
        for request in claims_first:
            hit = hits.get(request)
            try:
                if hit is not None and hit.retained:
                    request.row = rows.allocate(hit.row, keep=hit.length)
                else:
                    request.row = rows.allocate()
                    if hit is not None:
                        plan.copies.append((request, hit))
            except Exception as exc:  # a failed placement fails its request only
                plan.failed.append((request, exc))

    def _batches(
        self, chunks: list[PrefillChunk], decision: SchedulerOutput
    ) -> list[tuple[StepBatch, list[Request]]]:
        """One EXTEND batch where the runner mixes steps and the step fits one forward
        (``RunnerCapabilities.mixed_limits``); otherwise one batch per kind: new prompts (in the
        EXTEND batch where ``prefill_as_extend``), continued chunks, decodes (first where every live
        row must step together, ``live_rows_step_together``).

        A decode with a draft is a verify line, which wants the logits of all its positions
        (``StepBatch.logit_counts``): it rides in the mixed batch only where the runner's mixed
        forward returns them (``mixed_verify``), within the same limits; otherwise the step's verify
        lines come as an EXTEND batch of their own, right after the decodes."""
        capabilities = self.capabilities
        lines = [_decode_line(r, decision.drafts.get(r, ())) for r in decision.decode]
        decode = [line for line in lines if len(line[2]) == 1]
        verify = [line for line in lines if len(line[2]) > 1]
        if capabilities.mixed_steps:
            riding, apart = (lines, []) if capabilities.mixed_verify else (decode, verify)
            mixed = [_chunk_line(c) for c in chunks] + riding
            limits = capabilities.mixed_limits
            if mixed and (
                limits is None or limits.fits([line[1] for line in mixed], [len(line[2]) for line in mixed])
            ):
                verifies = len(riding) > len(decode)
                return [_batch(BatchKind.EXTEND, mixed, len(riding), verifies), *_verify_batches(apart)]
        batches = []
        decode_first = capabilities.live_rows_step_together or capabilities.mixed_steps
        if decode_first:
            batches += _decode_batches(decode, verify)
        fresh = [_chunk_line(c) for c in chunks if c.start == 0 and not capabilities.prefill_as_extend]
        more = [_chunk_line(c) for c in chunks if c.start > 0 or capabilities.prefill_as_extend]
        if fresh:
            batches.append(_batch(BatchKind.PREFILL, fresh))
        if more:
            batches.append(_batch(BatchKind.EXTEND, more))
        if not decode_first:
            batches += _decode_batches(decode, verify)
        return batches

    def finish(self, request: Request, keep_prefix: bool) -> None:
        """Forget a finished request and free its row; with prefix reuse on (and ``keep_prefix``),
        the row retains the K/V of what it holds for later prompts."""
        if request.row is not None:
            rows, prefix = self._table(), self.prefix
            # A speculative step may leave K/V past the last token it accepted (the tokens after an
            # EOS inside an accepted draft): only positions that hold the request's ids are kept.
            held = min(rows.length(request.row), len(request.all_ids))
            keep = held if prefix is not None and keep_prefix else 0
            if keep < (prefix.min_tokens if prefix is not None else 1):
                keep = 0
            rows.remove(request.row, keep)
            if keep:
                prefix.retain(request.row, request.all_ids[:keep], request.adapter_id)  # type: ignore[union-attr]
            request.row = None
        if request.lora_slot is not None and self.adapters is not None:
            self.adapters.unpin(request.lora_slot)
            request.lora_slot = None
        if self.speculator is not None:  # a draft model's row goes with the target's
            self.speculator.release(request)
        self.remove(request)

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request, wherever it is."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


_Line = tuple[Request, int, "list[int] | tuple[int, ...]", bool]  # request, start, chunk, samples


def _chunk_line(chunk: PrefillChunk) -> _Line:
    return (chunk.request, chunk.start, chunk.tokens, chunk.final)


def _decode_line(request: Request, draft: tuple[int, ...] = ()) -> _Line:
    """A decode as a line: the request's newest token (and its draft), after every position its
    row holds."""
    start = len(request.prompt_ids) + len(request.output_ids) - 1
    return (request, start, (request.last_token, *draft), True)


def _decode_batches(decode: list[_Line], verify: list[_Line]) -> list[tuple[StepBatch, list[Request]]]:
    """The plain decodes as a DECODE batch, then the verify lines as an EXTEND batch."""
    batches = [_batch(BatchKind.DECODE, decode, len(decode))] if decode else []
    return batches + _verify_batches(verify)


def _verify_batches(verify: list[_Line]) -> list[tuple[StepBatch, list[Request]]]:
    """The verify lines (decodes with a draft) as an EXTEND batch of their own, if any."""
    return [_batch(BatchKind.EXTEND, verify, len(verify), verifies=True)] if verify else []


def _batch(
    kind: BatchKind, lines: list[_Line], decodes: int = 0, verifies: bool = False
) -> tuple[StepBatch, list[Request]]:
    """The batch of ``lines``; with ``verifies``, each decode line (the ``decodes`` last) wants the
    logits of all its positions, every other line those of its last."""
    requests = [line[0] for line in lines]
    counts = ()
    if verifies:
        first_decode = len(lines) - decodes
        counts = tuple(len(line[2]) if i >= first_decode else 1 for i, line in enumerate(lines))
    batch = StepBatch(
        kind,
        tuple(r.row for r in requests),  # type: ignore[misc]
        tuple(line[1] for line in lines),
        tuple(line[2] for line in lines),
        tuple(line[3] for line in lines),
        decodes,
        logit_counts=counts,
    )
    return batch, requests


def with_adapters(batch: StepBatch, requests: list[Request]) -> StepBatch:
    """``batch`` with its lines' LoRA slots, where any line has one (else ``batch`` itself)."""
    slots = tuple(r.lora_slot for r in requests)
    return replace(batch, adapters=slots) if any(s is not None for s in slots) else batch
