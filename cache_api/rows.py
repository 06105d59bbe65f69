"""Row bookkeeping for a KV cache: which rows are in use and how many positions each holds.

A row is one sequence slot of the rolling batch (``seq_id`` in transformers-neuronx, ``slot`` in
TGI). The table knows nothing about tensors, so the same object drives the CPU cache tensors, every
tensor-parallel rank's shard of them, and the device-resident cache of the Neuron runner.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class CacheError(RuntimeError):
    """Misuse of the KV cache: the message says which row, which position and why."""


class CacheFullError(CacheError):
    """No free row is left."""


@dataclass(frozen=True, slots=True)
class Occupancy:
    rows_total: int
    rows_used: int
    positions_used: int
    n_positions: int

    @property
    def rows_free(self) -> int:
        return self.rows_total - self.rows_used


class RowTable:
    """Free list and per-row lengths.

    Invariants: a row is either free (length 0) or in use; ``allocate`` hands out the lowest free
    row (so active rows stay packed at the front, which keeps decode slices contiguous); a length
    never exceeds ``n_positions``.
    """

    def __init__(self, n_rows: int, n_positions: int) -> None:
        if n_rows <= 0:
            raise ValueError(f"n_rows must be positive, got {n_rows}")
        if n_positions <= 0:
            raise ValueError(f"n_positions must be positive, got {n_positions}")
        self.n_rows = n_rows
        self.n_positions = n_positions
        self._free: list[int] = list(range(n_rows))
        self._in_use = [False] * n_rows
        self._lengths = [0] * n_rows

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.n_rows} KV rows are in use")
        row = heapq.heappop(self._free)
        self._in_use[row] = True
        self._lengths[row] = 0
        return row

    def remove(self, row: int) -> None:
        self.check_in_use(row)
        self._in_use[row] = False
        self._lengths[row] = 0
        heapq.heappush(self._free, row)

    def check_in_use(self, row: int) -> None:
        if not isinstance(row, int) or not (0 <= row < self.n_rows):
            raise CacheError(f"row {row!r} is out of range [0, {self.n_rows})")
        if not self._in_use[row]:
            raise CacheError(f"row {row} is not allocated")

    def length(self, row: int) -> int:
        self.check_in_use(row)
        return self._lengths[row]

    def lengths(self, rows: Sequence[int]) -> list[int]:
        return [self.length(r) for r in rows]

    def set_length(self, row: int, length: int) -> None:
        self.check_in_use(row)
        if not (0 <= length <= self.n_positions):
            raise CacheError(f"row {row}: length {length} is outside [0, {self.n_positions}]")
        self._lengths[row] = length

    def reserve_next(self, rows: Iterable[int]) -> list[int]:
        """Claim the next position of each row; returns the positions to write."""
        rows = list(rows)
        positions = self.lengths(rows)
        for row, pos in zip(rows, positions, strict=True):
            if pos >= self.n_positions:
                raise CacheError(
                    f"row {row} is full: cannot write position {pos} (n_positions={self.n_positions})"
                )
        for row, pos in zip(rows, positions, strict=True):
            self._lengths[row] = pos + 1
        return positions

    def in_use(self) -> list[int]:
        return [r for r in range(self.n_rows) if self._in_use[r]]

    def occupancy(self) -> Occupancy:
        used = self.in_use()
        return Occupancy(
            rows_total=self.n_rows,
            rows_used=len(used),
            positions_used=sum(self._lengths[r] for r in used),
            n_positions=self.n_positions,
        )
