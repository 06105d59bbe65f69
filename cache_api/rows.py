"""Row bookkeeping for a KV cache: which rows are in use and how many positions each holds.

A row is one sequence slot of the rolling batch (``seq_id`` in transformers-neuronx, ``slot`` in
TGI). The table knows nothing about tensors, so the same object drives the CPU cache tensors, every
tensor-parallel rank's shard of them, and the device-resident cache of the Neuron runner.

A freed row may *retain* its first positions (prefix reuse): it is free, but its K/V stay readable
until the row is allocated again, so a later request with the same prefix can claim it whole
(``allocate(row, keep)``) instead of recomputing it. Free rows that retain nothing are handed out
first, then retained rows, lowest first too: rows in use stay packed at the front of the cache, so a
decode step's rows are a short slice (a lone request in row 17 would make a compiled decode window
of 18 rows). Eviction order is by row, not by age: a prompt that matches a retained row claims it
before any allocation, prompts that match nothing churn through the lowest rows, and prefixes kept
in higher rows live longest::

    in use:        0 [a a a a a .. ..]   length 5
    free, clean:   1 [.. .. .. .. .. ..]  handed out first (lowest row first)
    free, retained 2 [b b b .. .. .. ..]  keep 3: claimable by a prompt starting with b b b
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

    Invariants: a row is either free (length 0) or in use; a free row is either clean or retains a
    prefix of ``retained(row)`` positions; ``allocate()`` hands out the lowest clean row (so active
    rows stay packed at the front, which keeps decode slices contiguous), else the lowest retained
    row; a length never exceeds ``n_positions``; ``generation(row)`` counts the
    row's allocations, so a reader that saw a retained row can tell whether it was reused since.
    """

    def __init__(self, n_rows: int, n_positions: int) -> None:
        if n_rows <= 0:
            raise ValueError(f"n_rows must be positive, got {n_rows}")
        if n_positions <= 0:
            raise ValueError(f"n_positions must be positive, got {n_positions}")
        self.n_rows = n_rows
        self.n_positions = n_positions
        self._free: list[int] = list(range(n_rows))  # clean free rows, a heap
        self._retained: dict[int, int] = {}  # free row -> kept positions
        self._in_use = [False] * n_rows
        self._lengths = [0] * n_rows
        self._generation = [0] * n_rows

    def allocate(self, row: int | None = None, keep: int = 0) -> int:
        """Hand out a free row (the policy above), or claim the free ``row`` given; ``keep`` > 0
        claims a retained row with its first ``keep`` positions, which become its length."""
        if row is None:
            if keep:
                raise CacheError("allocate: keep needs the retained row it applies to")
            if self._free:
                row = heapq.heappop(self._free)
            elif self._retained:
                row = min(self._retained)
                del self._retained[row]
            else:
                raise CacheFullError(f"all {self.n_rows} KV rows are in use")
        else:
            self._check_range(row)
            if self._in_use[row]:
                raise CacheError(f"allocate: row {row} is already in use")
            if keep > self._retained.get(row, 0) or keep < 0:
                raise CacheError(f"allocate: row {row} retains {self.retained(row)} positions, not {keep}")
            if row in self._retained:
                del self._retained[row]
            else:
                self._free.remove(row)
                heapq.heapify(self._free)
        self._in_use[row] = True
        self._lengths[row] = keep
        self._generation[row] += 1
        return row

    def remove(self, row: int, keep: int = 0) -> None:
        """Free ``row``; ``keep`` > 0 retains its first ``keep`` positions until it is allocated again."""
        self.check_in_use(row)
        if not (0 <= keep <= self._lengths[row]):
            raise CacheError(f"remove: row {row} holds {self._lengths[row]} positions, cannot keep {keep}")
        self._in_use[row] = False
        self._lengths[row] = 0
        if keep:
            self._retained[row] = keep
        else:
            heapq.heappush(self._free, row)

    def retained(self, row: int) -> int:
        """Positions a free row still holds for reuse (0 when in use or clean)."""
        self._check_range(row)
        return self._retained.get(row, 0)

    def generation(self, row: int) -> int:
        self._check_range(row)
        return self._generation[row]

    def _check_range(self, row: int) -> None:
        if not isinstance(row, int) or not (0 <= row < self.n_rows):
            raise CacheError(f"row {row!r} is out of range [0, {self.n_rows})")

    def check_in_use(self, row: int) -> None:
        self._check_range(row)
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
