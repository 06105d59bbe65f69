"""``EngineFront``: what the CPU/Neuron engine's two fronts share, written once.

    EngineFront        admit (liveness, overload, Admission), stop (refuse, drain, end), stats' shape
      ├─ AsyncEngine   the EngineCore on a thread of this process (the Neuron backends)
      └─ ProcessEngine the EngineCore in a process of its own (the CPU backend)

A front differs from the other only in its transport: how a request reaches the core, how events
come back, and what ends it. Those are the hooks (``_in_flight``, ``_capacity``, ``_busy``,
``_finish_stop``); the rest of the ``Engine`` protocol's lifecycle is here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Container, Sequence
from typing import Any

from neuron_lmi.engine.admission import Admission, Capacity, ValidRequest, check_accepting
from neuron_lmi.engine.types import EngineDeadError, SamplingParams

DRAIN_POLL_S = 0.05


class EngineFront:
    """An ``Engine`` over an ``EngineCore``; subclasses supply the transport.

    Invariants: ``admit`` is each request's one validation and refuses while the front is dead or
    stopping; ``stop`` refuses new work at once, lets what runs finish for ``grace_s``, then hands
    the rest to ``_finish_stop``.
    """

    def __init__(self, model_name: str, backend_name: str, model_dtype: str | None) -> None:
        self.model_name = model_name
        self.backend_name = backend_name
        self.model_dtype = model_dtype
        self._alive = False
        self._stopping = False
        self.failure: BaseException | None = None
        # Run once the engine is dead for good (the server's SERVING_FAIL_FAST exit).
        self.on_death: list[Callable[[BaseException], Any]] = []

    # -- what a transport supplies -------------------------------------------------------------
    admission: Admission

    def _in_flight(self) -> Container[str]:
        """The request ids already in flight (admission refuses a duplicate)."""
        raise NotImplementedError

    def _capacity(self) -> Capacity:
        """How many wait for a KV row and how many rows are free, as this front counts them."""
        raise NotImplementedError

    def _busy(self) -> bool:
        """Whether requests are still running or queued (``stop`` drains them)."""
        raise NotImplementedError

    async def _finish_stop(self) -> None:
        """After the drain: abort what is left, end the transport."""
        raise NotImplementedError

    def _dead_error(self) -> EngineDeadError | None:
        """Why the engine is down, where the transport knows better than ``check_accepting``."""
        return None

    # -- the Engine protocol's shared part -----------------------------------------------------
    def admit(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> ValidRequest:
        """Check and tokenize (raises ``InvalidRequestError``, ``EngineOverloadedError``,
        ``EngineDeadError``): the request's one validation."""
        self._check_accepting()
        return self.admission.admit(prompt, params, request_id, self._in_flight())

    def _check_accepting(self) -> None:
        error = self._dead_error()
        if error is not None:  # dead, or restarting: say when to come back
            raise error
        check_accepting(self._alive, self._stopping)
        self.admission.check_capacity(self._capacity())

    async def stop(self, grace_s: float = 10.0) -> None:
        """Refuse new work, let running requests finish for ``grace_s``, then abort the rest and
        end the transport."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self._alive and self._busy() and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        await self._finish_stop()

    def prometheus_collectors(self) -> list[Any]:
        return []  # the server's own series only
