"""The rolling-batch decision for one step: who is prefilled into a free row, who decodes.

Pure: it reads request lengths and the number of free rows and returns a ``SchedulerOutput``;
the engine applies it. Policies are small objects so a new one never grows this file's branches.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from neuron_lmi.engine.request import Request, Status


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """``prefill``: new requests to place into free rows. ``recompute``: running requests whose
    rows are encoded again from scratch (only the recompute baseline uses it). ``decode``: running
    requests that get one token this step."""

    prefill: list[Request] = field(default_factory=list)
    recompute: list[Request] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.prefill or self.recompute or self.decode)


class JoinPolicy(Protocol):
    def plan(self, admitted: list[Request], running: list[Request]) -> SchedulerOutput: ...


class InsertRows:
    """Continuous batching with the KV-row API: new rows are inserted, the others keep decoding."""

    def plan(self, admitted: list[Request], running: list[Request]) -> SchedulerOutput:
        return SchedulerOutput(prefill=admitted, decode=list(running))


class RecomputeOnJoin:
    """The pre-cache-API baseline: whenever a request joins, every active row is encoded again."""

    def plan(self, admitted: list[Request], running: list[Request]) -> SchedulerOutput:
        if admitted:
            return SchedulerOutput(prefill=admitted, recompute=list(running))
        return SchedulerOutput(decode=list(running))


class Scheduler:
    """FCFS admission into free rows within a prefill token budget.

    Invariants: a request is in exactly one of ``waiting`` and ``running`` until it finishes;
    at least one waiting request is admitted when a row is free, however long its prompt.
    """

    def __init__(self, max_prefill_tokens: int, policy: JoinPolicy | None = None) -> None:
        if max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        self.max_prefill_tokens = max_prefill_tokens
        self.policy = policy or InsertRows()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, free_rows: int) -> SchedulerOutput:
        admitted: list[Request] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(admitted) < free_rows:
            cost = len(self.waiting[0].all_ids)
            if admitted and cost > budget:
                break
            admitted.append(self.waiting.popleft())
            budget -= cost
        decision = self.policy.plan(admitted, self.running)
        for request in admitted:
            request.status = Status.RUNNING
            self.running.append(request)
        return decision

    def remove(self, request: Request) -> None:
        """Forget a finished or aborted request, wherever it is."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
