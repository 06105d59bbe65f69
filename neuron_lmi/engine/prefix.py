"""Prefix reuse: find a KV row that already holds the start of a new prompt.

Two kinds of source row::

    live      a running request's row: its first ``rows.length(row)`` positions hold
              ``all_ids[:length]``; the new request gets a copy (``runner.copy``)
    retained  a finished request's row, freed with ``RowTable.remove(row, keep)``: the new request
              claims the row itself with its first positions (``RowTable.allocate(row, keep)``)

The index keeps only bookkeeping (token ids per retained row, the LoRA adapter that computed them
and the row's generation when it was freed); it never reads a tensor. Rows are matched only within
one adapter (by registration id; None is the base model): an adapter changes every layer's K/V. A
retained row whose generation moved on was allocated since and is forgotten, so a stale row is
never matched.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from cache_api import RowTable
from neuron_lmi.engine.request import Request

DEFAULT_MIN_TOKENS = 16


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Reuse the first ``length`` positions of ``row``; ``retained``: claim the free row itself."""

    row: int
    length: int
    retained: bool


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, at most ``limit`` (binary search over
    slice comparisons, which run in C)."""
    limit = min(limit, len(a), len(b))
    if limit <= 0 or a[0] != b[0]:
        return 0
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 1, limit - 1  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixIndex:
    """Which token ids each reusable row holds.

    Invariants: a hit is at least ``min_tokens`` long and never covers a prompt's last token (its
    logits must be computed); a retained entry is matched only while its row's generation is the
    one recorded at ``retain``.
    """

    def __init__(self, rows: RowTable, min_tokens: int = DEFAULT_MIN_TOKENS) -> None:
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be at least 1, got {min_tokens}")
        self.rows = rows
        self.min_tokens = min_tokens
        # row -> (generation, adapter id, token ids)
        self._retained: dict[int, tuple[int, int | None, list[int]]] = {}

    def retain(self, row: int, ids: list[int], adapter: int | None = None) -> None:
        """Record that the just-freed ``row`` retains the K/V of ``ids``, computed with ``adapter``."""
        self._retained[row] = (self.rows.generation(row), adapter, ids)

    def match(
        self,
        prompt: Sequence[int],
        running: Iterable[Request],
        claimed: Collection[int],
        adapter: int | None = None,
    ) -> PrefixHit | None:
        """The longest reusable prefix of ``prompt`` computed with ``adapter`` (ties go to a
        retained row: no copy); retained rows in ``claimed`` are already taken this step."""
        limit = len(prompt) - 1
        if limit < self.min_tokens:
            return None
        best: PrefixHit | None = None
        for row, (generation, row_adapter, ids) in list(self._retained.items()):
            if self.rows.generation(row) != generation or not self.rows.retained(row):
                del self._retained[row]
            elif row not in claimed and row_adapter == adapter:
                n = common_prefix(prompt, ids, min(limit, self.rows.retained(row)))
                if best is None or n > best.length:
                    best = PrefixHit(row, n, retained=True)
        for request in running:
            if request.row is None or request.adapter_id != adapter:
                continue
            n = self._live_match(prompt, request, min(limit, self.rows.length(request.row)))
            if best is None or n > best.length:
                best = PrefixHit(request.row, n, retained=False)
        return best if best is not None and best.length >= self.min_tokens else None

    @staticmethod
    def _live_match(prompt: Sequence[int], request: Request, limit: int) -> int:
        n = common_prefix(prompt, request.prompt_ids, limit)
        if n == len(request.prompt_ids) and n < limit:  # the row also holds generated tokens
            n += common_prefix(prompt[n:], request.output_ids, limit - n)
        return n
