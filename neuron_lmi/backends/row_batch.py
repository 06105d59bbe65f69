"""What both Neuron runners (transformers-neuronx's and NxD Inference's) do around a compiled
continuous-batching forward: check prompts against the row table, and lay out one token-generation
call over device rows.

A compiled batch writes every line it is given into the KV row its seq_id names, and pads a partial
batch with copies of one of its lines. So a call lists every live row (the rows that are not asked
to step ride along at their next, unwritten position, where the padding write is harmless), in
ascending seq_id order (releases that return a full batch ungathered then agree with those that
gather), and the logits are mapped back to the order asked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cache_api import RowTable
from neuron_lmi.runners.base import ascending, in_asked_order

PAD_TOKEN_ID = 0  # the token a riding-along row feeds; its logits are dropped


def check_prompts(
    table: RowTable, rows: Sequence[int], prompts: Sequence[Sequence[int]], n_positions: int
) -> None:
    """Raise ``ValueError`` unless each prompt is non-empty, fits ``n_positions`` and goes to a row in use."""
    if len(rows) != len(prompts):
        raise ValueError("prefill: rows and prompts differ in length")
    for row, prompt in zip(rows, prompts, strict=True):
        table.check_in_use(row)
        if not prompt:
            raise ValueError(f"prefill: prompt for row {row} is empty")
        if len(prompt) > n_positions:
            raise ValueError(f"prefill: prompt of {len(prompt)} tokens exceeds n_positions={n_positions}")


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """One token-generation call, lines in ascending seq_id order; the first ``asked`` entries of
    the unsorted layout are the rows asked to step, the rest ride along."""

    seq_ids: torch.Tensor  # [n] long, ascending
    tokens: torch.Tensor  # [n] long
    positions: torch.Tensor  # [n] long: the position each line writes
    order: list[int]  # line j of the call is entry order[j] of the unsorted layout
    asked: int

    def restore(self, logits: torch.Tensor) -> torch.Tensor:
        """The call's ``[n, vocab]`` logits back in the order asked, riders dropped."""
        return in_asked_order(logits, self.order)[: self.asked]


# A live row that is not asked to step: the (token, position) it writes this call, or None to leave
# it out of the call (the library then fills its line with a copy of another).
RiderWrite = Callable[[int], "tuple[int, int] | None"]


def token_batch(
    table: RowTable,
    rows: list[int],
    tokens: list[int],
    n_positions: int,
    min_rider_length: int = 0,
    rider: RiderWrite | None = None,
) -> TokenBatch:
    """Reserve the next position of each of ``rows`` and lay out the call with every other live row
    riding along. By default a rider feeds ``PAD_TOKEN_ID`` at its next, unwritten position when it
    holds at least ``min_rider_length`` positions (NxD Inference needs 1: a line at position 0 would
    turn the call into a context encoding); ``rider`` replaces that rule."""
    if len(rows) != len(tokens):
        raise ValueError("decode: rows and tokens differ in length")
    positions = table.reserve_next(rows)
    asked = set(rows)

    def next_position(row: int) -> tuple[int, int] | None:
        length = table.length(row)
        return (PAD_TOKEN_ID, length) if min_rider_length <= length < n_positions else None

    writes = [(r, (rider or next_position)(r)) for r in table.in_use() if r not in asked]
    riders = [(r, w) for r, w in writes if w is not None]
    seq_ids = rows + [r for r, _ in riders]
    all_tokens = tokens + [w[0] for _, w in riders]
    all_positions = positions + [w[1] for _, w in riders]
    order = ascending(seq_ids)

    def laid_out(values: list[int]) -> torch.Tensor:
        return torch.tensor([values[i] for i in order], dtype=torch.long)

    return TokenBatch(laid_out(seq_ids), laid_out(all_tokens), laid_out(all_positions), order, len(rows))
