"""``AsyncEngine``: the rolling-batch engine on its own thread, behind the ``Engine`` protocol.

The engine thread is the only one that touches the scheduler, the runner and the KV cache. Other
threads talk to it through two thread-safe queues (new requests, aborts). The events of one step
travel back to the requests' mailboxes in one batch (``neuron_lmi.engine.streams.post``: one
``call_soon_threadsafe`` per step, not per token). torch releases the GIL inside its kernels, so
the event loop keeps running while a step computes.

This engine shares its process (and GIL) with the HTTP server; ``ProcessEngine`` runs the same
``EngineCore`` in a process of its own and is what the CPU backend serves with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Container
from typing import Any

from neuron_lmi.config.options import DEFAULT_MAX_QUEUE_SIZE
from neuron_lmi.engine.admission import Admission, Capacity, ValidRequest
from neuron_lmi.engine.core import EngineCore
from neuron_lmi.engine.detokenizer import TextSink, TokenTexts, text_stream
from neuron_lmi.engine.front import EngineFront
from neuron_lmi.engine.request import Request
from neuron_lmi.engine.step_clock import StepClock
from neuron_lmi.engine.streams import Mailbox, post, read_stream
from neuron_lmi.engine.types import (
    EngineStats,
    FinishReason,
    TokenEvent,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


class AsyncEngine(EngineFront):
    """Implements ``neuron_lmi.engine.protocol.Engine`` over an ``EngineCore`` on a thread (its
    admission and drain are ``EngineFront``'s).

    Invariants: at most ``max_queue_size`` requests beyond the free rows wait for a row (more are
    refused with ``EngineOverloadedError``); a stream that is closed before its last event aborts its
    request, which frees the row at the start of the next step; every event of a step reaches the
    event loop in one hop.
    """

    def __init__(
        self,
        core: EngineCore,
        model_name: str,
        max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        backend_name: str = "cpu",
        model_dtype: str | None = None,
    ) -> None:
        super().__init__(model_name, backend_name, model_dtype)
        self.core = core
        self._texts = TokenTexts(core.tokenizer)  # each token id's text, decoded once
        self.n_positions = core.runner.n_positions
        self.max_batch_size = core.runner.rows.n_rows
        self.max_queue_size = max_queue_size
        self.admission = Admission(core.tokenizer.encode, core.admission_limits(max_queue_size))
        self.admission.adapters = core.admission.adapters  # the start-up adapters (no loading at run time)
        self._clock = StepClock(core.forward_timer, core.runner.rows.n_rows)
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._aborts: queue.Queue[str] = queue.Queue()
        self._outbox: list[tuple[Mailbox, TokenEvent | BaseException]] = []  # engine thread only
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending = 0  # submitted but not yet picked up by the engine thread
        self._lock = threading.Lock()

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

    def _in_flight(self) -> Container[str]:
        return self.core.requests

    def _capacity(self) -> Capacity:
        waiting = len(self.core.scheduler.waiting) + self._pending
        return Capacity(waiting, self.core.runner.rows.occupancy().rows_free)

    def _busy(self) -> bool:
        return self.core.has_work() or bool(self._pending)

    async def _finish_stop(self) -> None:
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
                self._clock.begin()
                self._drain()
                if self.core.has_work():
                    self.core.step()
                    self._flush()
                    self._clock.end()
                else:
                    self._flush()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # the loop dying must be loud: /ping turns unhealthy
            log.exception("engine loop died")
            self.failure = exc
            self._alive = False
            with contextlib.suppress(Exception):
                self._drain()  # submitted but not yet taken: they end with ABORT like the others
            for request_id in list(self.core.requests):
                self.core.abort(request_id)
            self._flush()
            for callback in self.on_death:
                callback(exc)

    def _flush(self) -> None:
        """Hand this iteration's events to the event loop(s) in one hop each."""
        if self._outbox:
            batch, self._outbox = self._outbox, []
            post(batch)

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
    def generate(self, valid: ValidRequest) -> AsyncIterator[TokenEvent]:
        """Submit an admitted request now (so the next ``admit`` counts it against capacity) and
        stream its events; a stream never read still runs to its end."""
        params = valid.params
        mailbox = Mailbox(asyncio.get_running_loop())

        def sink(event: TokenEvent) -> None:  # on the engine thread
            self._outbox.append((mailbox, event))

        def stop() -> None:  # a stop sequence ended it: the row is freed at the next step
            self._aborts.put(request.request_id)

        request = self.core.request_of(valid)
        text = text_stream(self.core.tokenizer, request.prompt_ids, params)
        request.sink = TextSink(text, self._texts, sink, stop)
        with self._lock:
            self._pending += 1
        self._inbox.put(request)
        self._wake.set()
        return self._stream(request, mailbox)

    async def _stream(self, request: Request, mailbox: Mailbox) -> AsyncIterator[TokenEvent]:
        def abandon() -> None:
            self._aborts.put(request.request_id)
            self._wake.set()

        async for event in read_stream(mailbox, abandon, lambda: self._alive):
            yield event

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
            extra={**stats.extra, **self._clock.snapshot()},
        )


__all__ = ["AsyncEngine", "FinishReason"]
