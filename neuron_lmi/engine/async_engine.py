"""``AsyncEngine``: the rolling-batch engine on its own thread, behind the ``Engine`` protocol.

The engine thread is the only one that touches the scheduler, the runner and the KV cache. Other
threads talk to it through two thread-safe queues (new requests, aborts); token events travel back
to each request's asyncio queue with ``call_soon_threadsafe``. torch releases the GIL inside its
kernels, so the event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from neuron_lmi.engine.build import CpuEngineOptions, build_cpu_engine_core
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.request import Request
from neuron_lmi.engine.scheduler import JoinPolicy
from neuron_lmi.engine.types import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStats,
    FinishReason,
    SamplingParams,
    TokenEvent,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


class AsyncEngine:
    """Implements ``neuron_lmi.engine.protocol.Engine`` over an ``EngineCore``.

    Invariants: at most ``max_queue_size`` requests beyond the free rows wait for a row (more are
    refused with ``EngineOverloadedError``); a stream that is closed before its last event aborts its request,
    which frees the row at the start of the next step.
    """

    backend_name = "cpu"

    def __init__(self, core: EngineCore, model_name: str, max_queue_size: int = 256) -> None:
        self.core = core
        self.model_name = model_name
        self.n_positions = core.runner.n_positions
        self.max_batch_size = core.runner.rows.n_rows
        self.max_queue_size = max_queue_size
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._aborts: queue.Queue[str] = queue.Queue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._alive = False
        self._pending = 0  # submitted but not yet picked up by the engine thread
        self._lock = threading.Lock()
        self.failure: BaseException | None = None
        self.on_death: list[Any] = []

    @classmethod
    def from_options(
        cls,
        model: str = "smollm2",
        *,
        max_queue_size: int = 256,
        policy: JoinPolicy | None = None,
        **options: Any,
    ) -> AsyncEngine:
        core, _config = build_cpu_engine_core(CpuEngineOptions(model=model, **options), policy)
        return cls(core, model_name=model, max_queue_size=max_queue_size)

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._alive = True
        self._thread = threading.Thread(target=self._run, name="neuron-lmi-engine", daemon=True)
        self._thread.start()

    async def stop(self, grace_s: float = 10.0) -> None:
        """Refuse new work, let running requests finish for ``grace_s``, then abort the rest."""
        self._stopping.set()
        deadline = time.monotonic() + grace_s
        while self._alive and (self.core.has_work() or self._pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(self.core.requests):
            self._aborts.put(request_id)
        self._wake.set()
        await asyncio.sleep(0.1)
        self._alive = False
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)

    def _run(self) -> None:
        try:
            while self._alive:
                self._drain()
                if self.core.has_work():
                    self.core.step()
                else:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # the loop dying must be loud: /ping turns unhealthy
            log.exception("engine loop died")
            self.failure = exc
            self._alive = False
            for request_id in list(self.core.requests):
                self.core.abort(request_id)
            for callback in self.on_death:
                callback(exc)

    def _drain(self) -> None:
        while True:
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                self._pending -= 1
            self.core.add(request)
        while True:
            try:
                self.core.abort(self._aborts.get_nowait())
            except queue.Empty:
                break

    # -- requests -----------------------------------------------------------------------------
    def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[TokenEvent]:
        """Validate now (raises ``InvalidRequestError``/``EngineOverloadedError``), stream later."""
        self._check_accepting()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        request = self.core.make_request(
            prompt, params, request_id, sink=lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        )
        return self._stream(request, events)

    def _check_accepting(self) -> None:
        if not self._alive:
            raise EngineDeadError("the engine loop is not running")
        if self._stopping.is_set():
            raise EngineOverloadedError("the server is shutting down", retry_after_s=5.0)
        waiting = len(self.core.scheduler.waiting) + self._pending
        free_rows = self.core.runner.rows.occupancy().rows_free
        if waiting >= self.max_queue_size + free_rows:
            raise EngineOverloadedError(
                f"{waiting} requests are already waiting for a KV row "
                f"({free_rows} free, max_queue_size={self.max_queue_size})"
            )

    async def _stream(self, request: Request, events: asyncio.Queue[TokenEvent]) -> AsyncIterator[TokenEvent]:
        self._check_accepting()
        with self._lock:
            self._pending += 1
        self._inbox.put(request)
        self._wake.set()
        finished = False
        try:
            while True:
                event = await self._next_event(events)
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self._aborts.put(request.request_id)
                self._wake.set()

    async def _next_event(self, events: asyncio.Queue[TokenEvent]) -> TokenEvent:
        # asyncio.wait keeps the pending get alive across polls; wait_for(get) can drop an event
        # when its timeout races the put (Python 3.11).
        getter = asyncio.ensure_future(events.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=1.0)
                if done:
                    return getter.result()
                if not self._alive:
                    raise EngineDeadError("the engine loop stopped while the request was running")
        finally:
            if not getter.done():
                getter.cancel()

    async def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        stats = self.core.stats(alive=self._alive)
        return EngineStats(
            rows_total=stats.rows_total,
            rows_used=stats.rows_used,
            positions_used=stats.positions_used,
            waiting=stats.waiting + self._pending,
            running=stats.running,
            alive=stats.alive,
            extra={"steps": float(self.core.steps)},
        )


__all__ = ["AsyncEngine", "FinishReason"]
