"""Driving the engine for HTTP: prime a request, stream or collect it, and always release it.

A request is *primed* before any response header is sent: its first token event is awaited, so
validation and overload errors raised by the engine still become proper HTTP statuses. After that,
whatever happens (normal end, client disconnect, server error), ``TokenStream.aclose`` closes the
engine iterator and aborts the request if it had not finished, which frees its KV row.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from neuron_lmi.engine.protocol import Engine
from neuron_lmi.engine.types import (
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    TokenEvent,
    UnknownAdapterError,
)
from neuron_lmi.server.errors import ApiError
from neuron_lmi.server.metrics import ServerMetrics

T = TypeVar("T")


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def is_token(event: TokenEvent) -> bool:
    """Whether the event carries a generated token (an abort or error end has ``token_id < 0``)."""
    return event.token_id >= 0


def failure_of(event: TokenEvent) -> ApiError | None:
    """The error a client must see when the engine ended the request itself (error or abort)."""
    if event.error is not None or event.finish_reason is FinishReason.ERROR:
        return ApiError(500, f"generation failed: {event.error or 'engine error'}", None, "generation")
    if event.finish_reason is FinishReason.ABORT:
        message = "the engine aborted the request (it is shutting down or its loop failed)"
        return ApiError(503, message, None, "unavailable")
    return None


class TokenStream:
    """One engine request, iterated after ``prime`` received its first event.

    Invariants: events are yielded in order, the first one exactly once; after ``aclose`` the
    engine iterator is closed and, if no event carried ``finish_reason``, ``engine.abort`` was
    called (the abort frees its KV row).
    """

    def __init__(
        self, engine: Engine, metrics: ServerMetrics, it: AsyncIterator[TokenEvent], request_id: str
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.request_id = request_id
        self._it = it
        self._first: TokenEvent | None = None
        self._t0 = time.perf_counter()
        self._last = self._t0
        self.finished = False
        self.closed = False
        self.prompt_tokens = 0

    async def prime(self) -> None:
        """Await the first event (raising the engine's refusal, if any)."""
        first = await anext(self._it)
        self._first = first
        self.prompt_tokens = first.prompt_tokens
        self.metrics.prompt_tokens.inc(first.prompt_tokens)
        self._record(first, first=True)

    def _record(self, event: TokenEvent, first: bool) -> None:
        now = time.perf_counter()
        if first:
            self.metrics.ttft.observe(now - self._t0)
        else:
            self.metrics.itl.observe(now - self._last)
        self._last = now
        if is_token(event):
            self.metrics.generated_tokens.inc()
        if event.finish_reason is not None:
            self.finished = True
            self.metrics.e2e.observe(now - self._t0)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        if self._first is not None:
            event, self._first = self._first, None
            yield event
            if event.finish_reason is not None:
                return
        async for event in self._it:
            self._record(event, first=False)
            yield event
            if event.finish_reason is not None:
                return

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            await self._it.aclose()  # type: ignore[attr-defined]
        if not self.finished:  # Engine.generate submitted it before returning ``it``
            self.metrics.aborted.inc()
            with contextlib.suppress(Exception):
                await self.engine.abort(self.request_id)


async def _prime(stream: TokenStream) -> TokenStream:
    """Wait for the first event; a refusal marks the stream finished (nothing ran, nothing to abort)."""
    try:
        await stream.prime()
    except StopAsyncIteration:
        raise RuntimeError(f"engine ended request {stream.request_id} without any event") from None
    except Exception:
        stream.finished = True
        raise
    return stream


async def open_streams(
    engine: Engine,
    metrics: ServerMetrics,
    jobs: Sequence[tuple[str | Sequence[int], SamplingParams]],
    prefix: str,
    renames: Mapping[str, str] | None = None,
    client: Request | None = None,
) -> list[TokenStream]:
    """Admit every job (its one validation: ``Engine.admit``), submit them at once (so they prefill
    together) and wait for each first event.

    A refusal names the engine's field; ``renames`` maps it to the request field the client set
    where the route knows better than the family's table (``max_completion_tokens``). If any is
    refused, the wait is cancelled or the ``client`` disconnects while they wait (a queued request
    may wait for a row for minutes), all of them are released before the error propagates.
    """
    base = new_request_id(prefix)
    streams: list[TokenStream] = []
    try:
        for i, (prompt, params) in enumerate(jobs):
            rid = base if len(jobs) == 1 else f"{base}-{i}"
            try:
                valid = engine.admit(prompt, params, rid)
            except InvalidRequestError as exc:
                name = (renames or {}).get(exc.field or "")
                if name is None:
                    raise
                if isinstance(exc, UnknownAdapterError):
                    raise UnknownAdapterError(exc.adapter, name) from None
                raise InvalidRequestError(str(exc).replace(exc.field or "", name, 1), name) from None
            streams.append(TokenStream(engine, metrics, engine.generate(valid), rid))
        await (until_disconnect(client, _prime_all(streams)) if client is not None else _prime_all(streams))
    except BaseException:
        await close_all(streams)
        raise
    return streams


async def _prime_all(streams: Sequence[TokenStream]) -> None:
    """Wait for every first event; the first refusal cancels the other waits at once (a request
    queued behind a busy row must not hold the error response until that row frees)."""
    tasks = [asyncio.ensure_future(_prime(s)) for s in streams]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
    if errors:
        raise errors[0]


async def close_all(streams: Sequence[TokenStream]) -> None:
    for s in streams:
        await s.aclose()


@dataclass(slots=True)
class Collected:
    """A finished request: its events in order and the text they print."""

    events: list[TokenEvent] = field(default_factory=list)
    prompt_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def tokens(self) -> list[TokenEvent]:
        return [e for e in self.events if is_token(e)]

    @property
    def finish_reason(self) -> FinishReason:
        last = self.events[-1] if self.events else None
        return last.finish_reason if last and last.finish_reason else FinishReason.ABORT

    def failure(self) -> ApiError | None:
        if not self.events:
            return ApiError(503, "the engine ended the request without output", None, "unavailable")
        return failure_of(self.events[-1])

    @property
    def generated_tokens(self) -> int:
        return sum(1 for e in self.events if is_token(e))


async def collect(stream: TokenStream) -> Collected:
    """Read ``stream`` to its end, then release it."""
    out = Collected(prompt_tokens=stream.prompt_tokens)
    try:
        async for event in stream:
            out.events.append(event)
    finally:
        await stream.aclose()
    return out


async def merge(streams: Sequence[TokenStream]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """Interleave several streams as events arrive, tagged with the stream's index."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | None]] = asyncio.Queue()

    async def pump(i: int, s: TokenStream) -> None:
        try:
            async for event in s:
                await queue.put((i, event))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, event = await queue.get()
            if event is None:
                remaining -= 1
                continue
            yield i, event
        for t in tasks:
            await t  # surface an engine failure raised inside a pump
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` but cancel it when the client goes away (its ``finally`` blocks release rows)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise asyncio.CancelledError("client disconnected")
        return task.result()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


class ReleasingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator and the engine streams behind it.

    Starlette cancels the sending task on disconnect but leaves the body generator suspended until
    garbage collection; closing it here makes the abort (and the KV row release) immediate.
    """

    def __init__(self, content: AsyncIterator[Any], streams: Sequence[TokenStream], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._streams = list(streams)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            await close_all(self._streams)
