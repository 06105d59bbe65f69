"""The contract between the rolling-batch engine and a backend: a step batch in, logits out.

The scheduler (``engine.scheduler``) owns the rows and emits each step as one or more
``StepBatch``es; a runner computes one batch per ``forward`` call. What a runner can do, or needs
of the step, is its ``RunnerCapabilities``, read once when the engine is built.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cache_api import RowTable


class BatchKind(enum.Enum):
    """What a batch's lines are, so a runner with one graph per kind picks it without looking:

    PREFILL  every line starts at position 0 (a whole prompt, or its first chunk)
    DECODE   every line is one token after the positions its row holds
    EXTEND   lines continue their rows with chunks of any length (prompt chunks, and in a mixed
             step decodes as one-token chunks); only for runners with ``capabilities.extend``
    """

    PREFILL = "prefill"
    DECODE = "decode"
    EXTEND = "extend"


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One forward's worth of work: line ``i`` writes ``chunks[i]`` into ``rows[i]`` from position
    ``starts[i]`` and yields the logits of its last ``logit_counts[i]`` tokens (its last token
    where ``logit_counts`` is empty, as in every batch without speculation).

    Invariants: rows are distinct and allocated; ``starts[i] + len(chunks[i]) <= n_positions``;
    ``samples[i]`` says whether the engine samples line ``i`` (a prompt chunk that is not its
    prompt's last samples nothing); ``decodes`` counts the lines that are a row's decode (what the
    step clock reports as the batch size). ``logit_counts`` is empty or one count per line, each in
    ``1 .. len(chunks[i])``, and only in EXTEND batches: a speculative decode (``[last token, d1..dk]``)
    is verified from the logits of all its ``k + 1`` positions. The runner writes rows from
    ``starts``, whatever lengths they hold, so a failed batch can be sent again line by line.

    ``adapters``: the LoRA slot of each line (None for a line of the base model), or None when no
    line is adapted: the common case, which a runner takes without looking at adapters at all. Only
    for runners with ``capabilities.lora``; the slots are the ones ``set_adapter`` filled.
    """

    kind: BatchKind
    rows: tuple[int, ...]
    starts: tuple[int, ...]
    chunks: tuple[Sequence[int], ...]
    samples: tuple[bool, ...]
    decodes: int = 0
    adapters: tuple[int | None, ...] | None = None
    logit_counts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        counts = self.logit_counts
        if counts and (self.kind is not BatchKind.EXTEND or len(counts) != len(self.rows)):
            raise ValueError(f"logit_counts {counts} need an EXTEND batch with one count per line")
        if any(not 1 <= n <= len(c) for n, c in zip(counts, self.chunks, strict=False)):
            raise ValueError(f"logit_counts {counts} must each be in 1 .. the line's chunk length")

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def n_logits(self) -> int:
        """Rows of logits ``forward`` returns: one per line, or ``sum(logit_counts)``."""
        return sum(self.logit_counts) if self.logit_counts else len(self.rows)

    def line(self, i: int) -> StepBatch:
        """Line ``i`` alone, as a batch of its own kind (a failed batch's retry)."""
        one = self.chunks[i]
        counts = (self.logit_counts[i],) if self.logit_counts else ()
        verifies = bool(counts) and counts[0] > 1  # a speculative decode
        decodes = 1 if self.kind is BatchKind.DECODE or (self.decodes and (len(one) == 1 or verifies)) else 0
        slot = self.adapters[i] if self.adapters is not None else None
        adapters = (slot,) if slot is not None else None
        rows, starts, samples = (self.rows[i],), (self.starts[i],), (self.samples[i],)
        return StepBatch(self.kind, rows, starts, (one,), samples, decodes, adapters, counts)


@dataclass(frozen=True, slots=True)
class LineSampling:
    """What the device sampler draws one line's token from: the ``top_k`` most likely tokens, then
    the ``top_p`` mass, at ``temperature`` (``top_k == 1``: the most likely token, greedy)."""

    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0


GREEDY_LINE = LineSampling()


@dataclass(frozen=True, slots=True)
class DeviceSampling:
    """A runner whose device draws each line's token (``forward_sampled``).

    ``per_line``: each line's ``LineSampling`` is honoured (else the device takes the most likely
    token whatever is asked: greedy only). ``max_top_k``: the largest top-k it draws from; a request
    with no top-k limit is drawn from these many most likely tokens. ``logits``: the logits come back
    beside the tokens, so a line the device cannot sample for (log-probabilities, penalties, a
    grammar, a seed...) is sampled on the host from them.
    """

    per_line: bool = True
    max_top_k: int = 1
    logits: bool = True


@dataclass(frozen=True, slots=True)
class SampledStep:
    """A ``forward_sampled`` result: ``tokens`` long ``[len(batch)]``, the device's draw for each
    line; ``logits`` fp32 ``[len(batch), vocab]`` where ``DeviceSampling.logits``, else None.

    ``runs`` (a runner with ``capabilities.fused_speculation``, DECODE batches only): each line's
    tokens as the device accepted them, ``runs[i][0] == tokens[i]``, 1 to ``fused_speculation``
    each; the logits are those of each line's first position. None: one token per line."""

    tokens: torch.Tensor
    logits: torch.Tensor | None
    runs: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True, slots=True)
class MixedStepLimits:
    """What one mixed forward (an EXTEND batch of decodes beside prompt chunks) takes: at most
    ``tokens`` tokens in all, every line ending before position ``end``, and the multi-token
    chunks' attention (query, key) pairs, ``n * start + n * (n + 1) / 2`` each, within ``pairs``
    (None: any). A step past them is cut by the scheduler into a DECODE and an EXTEND batch."""

    tokens: int
    pairs: int | None
    end: int

    def fits(self, starts: Sequence[int], lengths: Sequence[int]) -> bool:
        spans = list(zip(starts, lengths, strict=True))
        if sum(lengths) > self.tokens or max(s + n for s, n in spans) >= self.end:
            return False
        return self.pairs is None or sum(n * s + n * (n + 1) // 2 for s, n in spans if n > 1) <= self.pairs


@dataclass(frozen=True, slots=True)
class RunnerCapabilities:
    """What a runner can do and what it asks of the step; read once when the engine is built.

    ``extend``: EXTEND batches (chunks after a cached prefix) and ``copy``, so prompts may be split
    (chunked prefill) and start from another row's prefix (prefix reuse).
    ``mixed_steps``: one EXTEND batch may carry the step's decodes (one-token chunks) beside its
    prompt chunks; the scheduler then emits each step as a single batch.
    ``prompt_logits``: the runner scores whole prompts (prompt log-probabilities).
    ``live_rows_step_together``: every row that holds a sequence must be in each DECODE batch.
    A compiled continuous-batching graph (NxD Inference) writes a K/V entry for every line of its
    batch; a row left out is either filled in with another line's token or rides along, and in a
    sliding-window ring cache any such write evicts a key the row still needs. The scheduler then
    puts the decodes before the step's new prompts, so a row being prefilled is never live during
    a decode and every running request steps in it.
    ``device_sampling``: the device draws the tokens (``forward_sampled``); None: logits only.
    ``lora_slots``: how many LoRA adapters the runner holds at once (``set_adapter``; batches may
    then carry ``StepBatch.adapters``); 0: no adapters (admission refuses a request for one).
    ``lora_rank``: the largest adapter rank a slot holds.

    What one forward takes, so that the scheduler cuts each step into batches the runner computes as
    they come (a runner never splits or re-routes a batch): ``max_chunk_tokens``, the longest line
    (None: any; prompts longer are split into chunks, which needs ``extend``); ``mixed_limits``,
    what one mixed EXTEND batch holds (None: any step); ``prefill_as_extend``, new prompts go in
    EXTEND batches from position 0 (a runner whose fast path is its extend graph), not PREFILL.

    Speculative decoding: ``max_verify_tokens``, the most trailing positions of one EXTEND line
    whose logits ``forward`` returns (``StepBatch.logit_counts``), so a row may verify up to
    ``max_verify_tokens - 1`` draft tokens in one forward (0: the last position only, and no
    speculation); ``mixed_verify``, a mixed EXTEND batch may carry such verify lines beside its
    decodes and prompt chunks (its mixed forward returns all-position logits). Without it the
    scheduler puts a step's verify lines in an EXTEND batch of their own.

    ``fused_speculation``: the device drafts and verifies by itself (NxD Inference's fused
    speculation: a draft model or an EAGLE head compiled into the token-generation graph), so a
    DECODE line comes back with up to this many accepted tokens (``SampledStep.runs``) and its row
    holds only the first one's K/V until the engine keeps the rest (``rows.set_length``); 0: one
    token per line. Such a runner takes no drafts from the engine (``max_verify_tokens`` stays 0).
    """

    extend: bool = False
    mixed_steps: bool = False
    prompt_logits: bool = False
    live_rows_step_together: bool = False
    device_sampling: DeviceSampling | None = None
    max_chunk_tokens: int | None = None
    mixed_limits: MixedStepLimits | None = None
    prefill_as_extend: bool = False
    lora_slots: int = 0
    lora_rank: int = 0
    max_verify_tokens: int = 0
    mixed_verify: bool = False
    fused_speculation: int = 0

    @property
    def lora(self) -> bool:
        return self.lora_slots > 0

    def __post_init__(self) -> None:
        if self.mixed_steps and not self.extend:
            raise ValueError("mixed_steps needs extend: a mixed step is one EXTEND batch")
        if (self.max_chunk_tokens is not None or self.prefill_as_extend) and not self.extend:
            raise ValueError("max_chunk_tokens and prefill_as_extend need extend: prompts go in chunks")
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")
        if self.mixed_limits is not None and not self.mixed_steps:
            raise ValueError("mixed_limits need mixed_steps")
        if self.max_verify_tokens and not self.extend:
            raise ValueError("max_verify_tokens needs extend: a verification is an EXTEND line")
        if self.mixed_verify and not (self.mixed_steps and self.max_verify_tokens):
            raise ValueError("mixed_verify needs mixed_steps and max_verify_tokens")
        if self.fused_speculation and (self.device_sampling is None or self.max_verify_tokens):
            raise ValueError("fused_speculation needs device_sampling, and no max_verify_tokens")


class ModelRunner(Protocol):
    """One model step on one backend.

    Invariants: ``forward`` computes one ``StepBatch`` and returns fp32 logits
    ``[batch.n_logits, vocab]`` in the batch's line order (one row per line; with
    ``logit_counts``, line ``i``'s last ``logit_counts[i]`` positions in order, which only a runner
    with ``capabilities.max_verify_tokens`` is sent), leaving each row ``starts[i] +
    len(chunks[i])`` positions long. ``copy`` (with ``capabilities.extend``) duplicates a row's
    first ``n`` positions into another allocated row; ``prompt_logits`` (with
    ``capabilities.prompt_logits``) scores a prompt without touching any row; ``forward_sampled``
    (with ``capabilities.device_sampling``) computes the batch as ``forward`` does and draws line
    ``i``'s token from ``sampling[i]`` on the device. ``set_adapter`` (with ``capabilities.lora``)
    puts an adapter's weights into a slot (None clears it); the engine calls it only for a slot no
    running line uses. Nothing above the runner knows bucket sizes or tensor layouts.
    """

    rows: RowTable
    vocab_size: int
    n_positions: int
    capabilities: RunnerCapabilities

    def forward(self, batch: StepBatch) -> torch.Tensor: ...

    def copy(self, src: int, dst: int, n: int) -> None: ...

    def prompt_logits(self, prompt: Sequence[int]) -> torch.Tensor: ...

    def forward_sampled(self, batch: StepBatch, sampling: Sequence[LineSampling]) -> SampledStep: ...

    def set_adapter(self, slot: int, adapter: Any) -> None: ...


class ForwardByKind:
    """``forward`` for a runner written as ``prefill``/``decode`` (and ``extend``) methods: a batch
    goes to the method of its kind. An EXTEND batch first sets each row's length to its line's
    start, which makes it idempotent (a failed batch is retried line by line). An EXTEND batch with
    ``logit_counts`` goes whole to ``verify`` (only where ``capabilities.max_verify_tokens``); the
    scheduler has already put its lines where the runner's capabilities say they go."""

    # What the subclass defines (annotations only, so a delegating wrapper's ``__getattr__`` still
    # answers for them); ``extend`` only where ``capabilities.extend``, ``verify`` only where
    # ``capabilities.max_verify_tokens``: ``verify(rows, chunks, logit_counts)`` is ``extend``
    # returning the logits of each line's last ``logit_counts[i]`` positions.
    rows: RowTable
    prefill: Callable[[Sequence[int], Sequence[Sequence[int]]], torch.Tensor]
    decode: Callable[[Sequence[int], Sequence[int]], torch.Tensor]
    extend: Callable[[Sequence[int], Sequence[Sequence[int]]], torch.Tensor]
    verify: Callable[[Sequence[int], Sequence[Sequence[int]], Sequence[int]], torch.Tensor]

    def forward(self, batch: StepBatch) -> torch.Tensor:
        if batch.kind is BatchKind.DECODE:
            return self.decode(batch.rows, [chunk[0] for chunk in batch.chunks])
        if batch.kind is BatchKind.PREFILL:
            return self.prefill(batch.rows, batch.chunks)
        for row, start in zip(batch.rows, batch.starts, strict=True):
            self.rows.set_length(row, start)
        if batch.logit_counts:
            return self.verify(batch.rows, batch.chunks, batch.logit_counts)
        return self.extend(batch.rows, batch.chunks)


def capabilities_of(runner: ModelRunner) -> RunnerCapabilities:
    """``runner.capabilities``, checked to be the record (read once, by the engine's constructor)."""
    capabilities = runner.capabilities
    if not isinstance(capabilities, RunnerCapabilities):
        name = type(runner).__name__
        raise TypeError(f"{name}.capabilities must be a RunnerCapabilities, got {capabilities!r}")
    return capabilities


def ascending(rows: Sequence[int]) -> list[int]:
    """The indices that put ``rows`` in ascending order (a runner that sends rows sorted)."""
    return sorted(range(len(rows)), key=rows.__getitem__)


def in_asked_order(logits: torch.Tensor, order: list[int]) -> torch.Tensor:
    """``logits`` computed with line j for entry ``order[j]`` (``ascending``), back in entry order;
    ``logits`` itself when the entries were already ascending."""
    if order == sorted(order):
        return logits
    unsorted = torch.empty_like(logits)
    unsorted[torch.tensor(order)] = logits
    return unsorted
