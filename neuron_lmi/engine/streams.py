"""Token events from an engine loop (a thread, or the reader of an engine process) to asyncio streams.

One step of the engine produces events for many requests. They reach the event loop as one batch:
a single ``call_soon_threadsafe`` per step (per event loop, in practice one), not one per token.
Each request reads its events from a ``Mailbox`` (a deque and a future to wake the reader), so a
token costs an append and, when the reader was waiting, one ``set_result``: no task, queue or
timeout per token.

    engine loop ──step──> [(mailbox, event), ...] ──post()──> loop.call_soon_threadsafe(_deliver, batch)
                                                                  └─> mailbox.events.append(event); wake
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from neuron_lmi.engine.types import EngineDeadError, TokenEvent


class Mailbox:
    """The events of one request, read by one coroutine on ``loop``.

    Invariants: ``events`` and ``waiter`` are touched on ``loop``'s thread only (``post`` hops
    there); ``closed`` is set once the event carrying ``finish_reason`` was delivered, or by
    ``fail`` (then ``error`` is raised to the reader once the events before it are read).
    """

    __slots__ = ("closed", "error", "events", "loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: deque[TokenEvent] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.error: BaseException | None = None
        self.closed = False

    def put(self, event: TokenEvent) -> None:
        """On the loop's thread."""
        if self.closed:
            return
        self.events.append(event)
        if event.finish_reason is not None:
            self.closed = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        """On the loop's thread: the reader gets ``error`` after any events already queued."""
        if self.closed:
            return
        self.error, self.closed = error, True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> TokenEvent:
        while not self.events:
            if self.error is not None:
                raise self.error
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.events.popleft()


def _deliver(batch: list[tuple[Mailbox, TokenEvent | BaseException]]) -> None:
    for mailbox, item in batch:
        if isinstance(item, BaseException):
            mailbox.fail(item)
        else:
            mailbox.put(item)


def post(batch: Iterable[tuple[Mailbox, TokenEvent | BaseException]]) -> None:
    """From any thread: deliver ``batch`` in order, with one hop per event loop involved.

    A loop that is already closed (its requests were abandoned) is skipped.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Mailbox, TokenEvent | BaseException]]] = {}
    for mailbox, item in batch:
        by_loop.setdefault(mailbox.loop, []).append((mailbox, item))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads these mailboxes
            loop.call_soon_threadsafe(_deliver, items)


async def read_stream(
    mailbox: Mailbox,
    on_abandon: Callable[[], None],
    alive: Callable[[], bool],
    dead: Callable[[], EngineDeadError | None] = lambda: None,
) -> AsyncIterator[TokenEvent]:
    """Yield a request's events up to the one carrying ``finish_reason``. Closing the iterator
    before that calls ``on_abandon`` (which aborts the request and frees its row). Where the engine
    is no longer ``alive`` the stream raises ``dead()`` (the engine's own account: a restart's
    ``Retry-After``), else a plain ``EngineDeadError``."""
    finished = False
    try:
        while True:
            if not mailbox.events and not mailbox.closed and not alive():
                raise dead() or EngineDeadError("the engine loop stopped while the request was running")
            event = await mailbox.get()
            finished = event.finish_reason is not None
            yield event
            if finished:
                return
    finally:
        if not finished:
            on_abandon()


class Answers:
    """One-off answers from another thread (the reader of an engine process) to the coroutines that
    asked, by token: the engine's replies to adapter loads and unloads.

    Invariant: each token is answered once; ``answer_all`` answers every one still waiting (the
    engine died or stopped under them).
    """

    def __init__(self) -> None:
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        self._last = 0

    def expect(self) -> tuple[int, asyncio.Future[Any]]:
        """A new token and the future its answer sets (on the running loop)."""
        self._last += 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._waiting[self._last] = (loop, future)
        return self._last, future

    def answer(self, token: int, value: Any) -> None:
        """From any thread; nothing when nobody waits (any more) for ``token``."""
        waiting = self._waiting.pop(token, None)
        if waiting is None:
            return
        loop, future = waiting

        def settle() -> None:
            if not future.done():
                future.set_result(value)

        with contextlib.suppress(RuntimeError):  # its event loop has closed: nobody waits
            loop.call_soon_threadsafe(settle)

    def answer_all(self, value: Any) -> None:
        for token in list(self._waiting):
            self.answer(token, value)
