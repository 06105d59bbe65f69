"""The contract between the rolling-batch engine and a backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cache_api import RowTable


class ModelRunner(Protocol):
    """One model step on one backend.

    Invariants: ``prefill`` writes each prompt into its (allocated) row from position 0 and returns
    the logits of its last token; ``decode`` appends one token to each row and returns its logits.
    Logits are fp32 ``[len(rows), vocab]`` in the order of ``rows``. Nothing above the runner knows
    bucket sizes or tensor layouts.
    """

    rows: RowTable
    vocab_size: int
    n_positions: int

    def prefill(self, rows: Sequence[int], prompts: Sequence[Sequence[int]]) -> torch.Tensor: ...

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor: ...


class ExtendingRunner(ModelRunner, Protocol):
    """A runner that can also append to a row that already holds a prefix (optional capability).

    ``extend`` writes ``chunks[i]`` after the positions ``rows[i]`` holds (attention over the cached
    prefix and the chunk, causal, sliding window respected) and returns each chunk's last-token
    logits; any chunk length that fits ``n_positions`` is accepted. ``copy`` duplicates a row's
    first ``n`` positions into another allocated row. Runners without them (the Neuron runners)
    get whole-prompt prefill from the engine.

    ``mixed_steps`` (optional, read per step): a chunk of one token after a row's prefix is that
    row's decode, and ``extend`` runs a whole step -- decodes and prompt chunks -- in one forward;
    the engine then sends each step as one call.
    """

    supports_extend: bool

    def extend(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor: ...

    def copy(self, src: int, dst: int, n: int) -> None: ...


@dataclass(frozen=True, slots=True)
class RunnerNeeds:
    """What a runner asks of the engine's step, read once when the engine is built.

    ``live_rows_step_together``: every row that holds a sequence must be in each ``decode`` call.
    A compiled continuous-batching graph (NxD Inference) writes a K/V entry for every line of its
    batch; a row left out is either filled in with another line's token or rides along, and in a
    sliding-window ring cache any such write evicts a key the row still needs. The engine then
    decodes before it prefills the step's new prompts, so a row being prefilled is never live
    during a decode and every running request steps in it.
    """

    live_rows_step_together: bool = False


DEFAULT_NEEDS = RunnerNeeds()


def runner_needs(runner: ModelRunner) -> RunnerNeeds:
    """``runner.needs`` where the runner declares it, else nothing special."""
    needs = getattr(runner, "needs", DEFAULT_NEEDS)
    if not isinstance(needs, RunnerNeeds):
        raise TypeError(f"{type(runner).__name__}.needs must be a RunnerNeeds, got {needs!r}")
    return needs


def supports_extend(runner: ModelRunner) -> bool:
    """Whether ``runner`` is an ``ExtendingRunner`` (chunked prefill and prefix reuse apply)."""
    return bool(getattr(runner, "supports_extend", False))


def supports_mixed_steps(runner: ModelRunner) -> bool:
    """Whether the engine should send a whole step (decodes and prompt chunks) as one ``extend``."""
    return supports_extend(runner) and bool(getattr(runner, "mixed_steps", False))


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
