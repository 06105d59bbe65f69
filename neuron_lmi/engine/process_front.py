"""``ProcessEngine``: the ``Engine`` protocol in the API process, the ``EngineCore`` in its own.

The engine process (``neuron_lmi.engine.process_worker``) only schedules, runs the model and samples;
this side tokenizes prompts, turns token ids into text (``TextStream``: detokenization and stop
sequences) and feeds each request's ``Mailbox``. The two exchange plain tuples over a pipe: one
message per request in, one message per engine step out. A reader thread receives each step's
message, does the text work for all of its events and hands them to the event loop in one hop, so
the event loop never waits on the engine and the engine never waits on HTTP.

A request whose text hits a stop sequence ends here at once; the engine is told to abort it (its
row is freed at the start of the engine's next step). If the engine process dies, every running
request fails with ``EngineDeadError`` (a 503 with ``Retry-After``), ``stats().alive`` turns false
(``/ping`` answers 503), and the reader starts a new engine process from the same factory, up to
``max_restarts`` times in the engine's life (0 with ``SERVING_FAIL_FAST``: the container is replaced
instead). Past that the ``on_death`` callbacks run and the engine stays dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Container, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from neuron_lmi.config.options import DEFAULT_MAX_QUEUE_SIZE
from neuron_lmi.engine import process_worker as wire
from neuron_lmi.engine.admission import Admission, Capacity, ValidRequest, check_accepting
from neuron_lmi.engine.detokenizer import TextStream, TokenTexts, text_decoder, text_stream
from neuron_lmi.engine.front import EngineFront
from neuron_lmi.engine.streams import Answers, Mailbox, post, read_stream
from neuron_lmi.engine.types import (
    EngineDeadError,
    EngineStats,
    FinishReason,
    InvalidRequestError,
    TokenEvent,
    UnknownAdapterError,
)

log = logging.getLogger(__name__)

STOP_JOIN_S = 5.0
MALLOC_HEAP_BYTES = 256 * 2**20
DEFAULT_MAX_RESTARTS = 3  # a crash that repeats is not one a restart fixes
RESTART_RETRY_AFTER_S = 10.0  # a restart loads the model again, from the compile cache


@dataclass(slots=True)
class _Live:
    """A request this side has submitted and not yet seen finish."""

    mailbox: Mailbox
    text: TextStream
    prompt_tokens: int
    tokens: int = 0
    adapter: str | None = None


class ProcessEngine(EngineFront):
    """Implements ``neuron_lmi.engine.protocol.Engine`` with the engine core in a spawned process
    (its admission and drain are ``EngineFront``'s).

    Invariants: the engine process is up from construction (the model is loaded) until ``stop``;
    at most ``max_batch_size + max_queue_size`` requests are in flight (more are refused with
    ``EngineOverloadedError``); a stream closed before its last event aborts its request; every
    request ends with exactly one event carrying ``finish_reason``, even when the engine dies.

    LoRA adapters (``AdapterHost``): ``adapters`` is this side's view of what the engine serves,
    which admission checks requests against. An adapter enters it once the engine has read it, and
    leaves it as soon as its unloading is asked for (new requests get 404 while the requests
    already sent finish). A restarted engine serves its start-up adapters only.
    """

    def __init__(
        self,
        factory: wire.CoreFactory,
        model_name: str,
        max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        model_dtype: str | None = None,
    ) -> None:
        super().__init__(model_name, "cpu", model_dtype)
        self.max_queue_size = max_queue_size
        self.max_restarts = max_restarts
        self.restarts = 0  # engine processes started after the first
        self._factory = factory
        self._send_lock = threading.Lock()
        self._live: dict[str, _Live] = {}  # single dict operations only: atomic under the GIL
        self._answers = Answers()  # the engine's replies to adapter loads and unloads
        self._sent = 0  # ADD messages sent
        self._received = 0  # ADD messages the engine has taken
        self._snapshot: tuple[Any, ...] = (0, 0, 0, 0, 0, {})
        self._reader: threading.Thread | None = None
        self._proc, self._conn, info = _spawn(factory)
        # Garbage collection or interpreter exit closes the socket; the engine process exits on EOF.
        self._finalizer = weakref.finalize(self, _shut_down, self._proc, self._conn)
        limits = dataclasses.replace(info.limits, max_queue_size=max_queue_size)
        self.n_positions = limits.n_positions
        self.max_batch_size = limits.max_batch_size
        self.vocab_size = limits.vocab_size
        self._tokenizer = info.tokenizer
        self._decode = text_decoder(info.tokenizer)
        self._texts = TokenTexts(info.tokenizer)
        self.admission = Admission(info.tokenizer.encode, limits)
        self.adapters: dict[str, str] = dict(info.adapters)
        self.admission.adapters = self.adapters

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._reader is not None:
            return
        self._alive = True
        self._reader = threading.Thread(target=self._read, name="neuron-lmi-engine-reader", daemon=True)
        self._reader.start()

    def _in_flight(self) -> Container[str]:
        return self._live

    def _capacity(self) -> Capacity:
        return Capacity.of_in_flight(len(self._live), self.max_batch_size)

    def _busy(self) -> bool:
        return bool(self._live)

    async def _finish_stop(self) -> None:
        """Abort what is left, let the aborts reach their streams, end the engine process."""
        for request_id in list(self._live):
            self._send((wire.ABORT, request_id))
        deadline = time.monotonic() + 1.0
        while self._alive and self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # let the ABORT events reach their streams
        self._send((wire.STOP,))
        await asyncio.to_thread(_wait, self._proc, STOP_JOIN_S)
        self._alive = False
        self._finalizer()
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, STOP_JOIN_S)

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError):  # the engine process is gone; the reader reports it
            pass

    # -- the reader thread --------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            reason = self._read_until_death()
            if self._stopping:
                self._alive = False
                self._end_all()
                return
            _wait(self._proc, 1.0)
            code = self._proc.returncode
            reason += "" if code is None else f" (exit code {code})"
            restarting = self.restarts < self.max_restarts
            log.error("%s; /ping now answers 503%s", reason, ", restarting it" if restarting else "")
            # The failure first: a stream that finds the engine dead raises it (with Retry-After).
            self.failure = EngineDeadError(reason, RESTART_RETRY_AFTER_S if restarting else None)
            self._alive = False
            if not restarting:
                self._die(self.failure)
                return
            self._end_all(self.failure)
            if not self._restart():
                if not self._stopping:  # a stop during the restart is no death
                    self._die(EngineDeadError(f"{reason}; every restart failed"))
                return

    def _die(self, failure: EngineDeadError) -> None:
        """The engine stays dead: the death callbacks run, then every open stream fails."""
        self.failure = failure
        for callback in self.on_death:
            callback(failure)
        self._end_all(failure)

    def _read_until_death(self) -> str:
        """Apply the engine's messages until it dies (or stops); why it ended."""
        try:
            while True:
                message = self._conn.recv()
                if message[0] == wire.OUT:
                    self._on_output(*message[1:])
                elif message[0] == wire.ADAPTER_DONE:
                    self._answers.answer(*message[1:])
                elif message[0] == wire.DEAD:
                    return f"the engine loop died: {message[1]}"
        except (EOFError, OSError):
            pass
        except BaseException:
            log.exception("the engine reader failed")
        return "the engine process exited"

    def _restart(self) -> bool:
        """Start a new engine process in the dead one's place (on the reader thread: requests meanwhile
        get 503 with ``Retry-After``); False once ``max_restarts`` starts have failed or been used."""
        while self.restarts < self.max_restarts and not self._stopping:
            self.restarts += 1
            self._finalizer()  # the dead process: reaped, its socket closed
            try:
                proc, conn, _info = _spawn(self._factory)
            except Exception as exc:
                log.error("engine restart %d of %d failed: %s", self.restarts, self.max_restarts, exc)
                continue
            if self._stopping:  # stop() ran meanwhile and waited on the dead process: end this one
                _shut_down(proc, conn)
                return False
            self._proc, self._conn = proc, conn
            self._finalizer = weakref.finalize(self, _shut_down, proc, conn)
            self._sent = self._received = 0
            self._snapshot = (0, 0, 0, 0, 0, {})
            self.adapters.clear()
            self.adapters.update(_info.adapters)
            self.failure = None
            self._alive = True
            log.warning(
                "engine process restarted (%d of %d); /ping answers 200", self.restarts, self.max_restarts
            )
            return True
        return False

    def _on_output(
        self, events: list[tuple[Any, ...]], rejected: list[tuple[str, str, str | None]],
        snapshot: tuple[Any, ...], received: int,
    ) -> None:  # fmt: skip
        batch: list[tuple[Mailbox, TokenEvent | BaseException]] = []
        for request_id, message, field in rejected:
            live = self._live.pop(request_id, None)
            if live is not None:
                unexpected = field == wire.UNEXPECTED
                error = RuntimeError(message) if unexpected else InvalidRequestError(message, field)
                if field == "adapter" and live.adapter is not None:  # unloaded since admission
                    error = UnknownAdapterError(live.adapter)
                batch.append((live.mailbox, error))
        stopped: list[str] = []
        for fields in events:
            request_id = fields[wire.REQUEST_ID]
            live = self._live.get(request_id)
            if live is None:
                continue  # ended here already (a stop sequence, an abandoned stream)
            finish = fields[wire.FINISH]
            if fields[wire.TOKEN_ID] >= 0:
                live.tokens += 1
                text, finish = live.text.add(fields[wire.TOKEN_ID], finish)
                if finish is FinishReason.STOP_SEQUENCE:
                    stopped.append(request_id)
                fields = wire.with_text(fields, self._texts(fields[wire.TOKEN_ID]), text, finish)
            if finish is not None:
                self._live.pop(request_id, None)
            event = TokenEvent(*fields)
            if event.top_tokens or event.prompt:  # only where asked for: alternatives' texts too
                top, prompt = self._texts.alternatives(event.top_tokens), self._texts.prompt(event.prompt)
                event = dataclasses.replace(event, top_tokens=top, prompt=prompt)
            batch.append((live.mailbox, event))
        self._snapshot, self._received = snapshot, received
        if batch:
            post(batch)
        for request_id in stopped:  # harmless when the engine ended it in the same step
            self._send((wire.ABORT, request_id))

    def _end_all(self, error: EngineDeadError | None = None) -> None:
        """End every stream still open: with ``error`` (the engine died under it), else with an
        ABORT event (the engine stopped); an adapter operation still waiting fails."""
        self._answers.answer_all((str(error or "the engine stopped"), wire.UNEXPECTED, False))
        batch: list[tuple[Mailbox, TokenEvent | BaseException]] = []
        for request_id in list(self._live):
            live = self._live.pop(request_id, None)
            if live is not None:
                batch.append((live.mailbox, error or _abort_event(request_id, live)))
        post(batch)

    # -- requests -----------------------------------------------------------------------------
    def generate(self, request: ValidRequest) -> AsyncIterator[TokenEvent]:
        """Submit an admitted request now and stream its events. Submitting here, not on the
        stream's first read, makes it count against capacity at once, so the next ``admit`` sees
        it; a stream never read still ends (its last event frees its entry). What only the engine
        process can tell (a grammar its tokenizer cannot serve) is raised from the stream's first
        step."""
        request_id, ids, params = request.request_id, request.prompt_ids, request.params
        if request_id in self._live:  # two requests admitted under one id before either was submitted
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
        mailbox = Mailbox(asyncio.get_running_loop())
        text = text_stream(self._tokenizer, ids, params, self._decode)
        live = self._live[request_id] = _Live(mailbox, text, len(ids), adapter=params.adapter)
        self._sent += 1
        self._send((wire.ADD, request_id, ids, wire.params_tuple(params)))
        return self._stream(request_id, live)

    def _dead_error(self) -> EngineDeadError | None:
        """A fresh copy of why the engine is down (with a restart's ``Retry-After``), or None."""
        failure = self.failure
        return (
            None if self._alive or failure is None else EngineDeadError(str(failure), failure.retry_after_s)
        )

    async def _stream(self, request_id: str, live: _Live) -> AsyncIterator[TokenEvent]:
        # An engine that died since submission ends the stream through read_stream's ``dead``.
        def abandon() -> None:
            if self._live.pop(request_id, None) is not None:
                self._send((wire.ABORT, request_id))

        async for event in read_stream(live.mailbox, abandon, lambda: self._alive, self._dead_error):
            yield event

    # -- adapters (AdapterHost) ---------------------------------------------------------------
    @property
    def serves_adapters(self) -> bool:
        return self.admission.limits.capabilities.lora

    async def load_adapter(self, name: str, path: str) -> None:
        """Have the engine read and register a LoRA adapter; raises ``InvalidRequestError``
        naming it and why (a rank, a base model, a target module, a path)."""
        check_accepting(self._alive, self._stopping)
        if name in self.adapters:
            raise InvalidRequestError(f"adapter {name!r} is already loaded", "lora_name")
        await self._adapter_call(wire.LOAD_ADAPTER, name, path)
        self.adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        """Stop serving an adapter at once (``UnknownAdapterError`` if not served); the requests
        already running with it finish, and the engine frees it after the last."""
        check_accepting(self._alive, stopping=False)  # a draining engine still unloads
        if self.adapters.pop(name, None) is None:
            raise UnknownAdapterError(name, "lora_name")
        await self._adapter_call(wire.UNLOAD_ADAPTER, name)

    async def _adapter_call(self, kind: str, *args: str) -> None:
        token, answer = self._answers.expect()
        self._send((kind, token, *args))
        outcome = await answer
        if outcome is not None:
            message, field, not_found = outcome
            if not_found:
                raise UnknownAdapterError(args[0], "lora_name")
            raise RuntimeError(message) if field == wire.UNEXPECTED else InvalidRequestError(message, field)

    async def abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            post([(live.mailbox, _abort_event(request_id, live))])
        self._send((wire.ABORT, request_id))

    def stats(self) -> EngineStats:
        rows_total, rows_used, positions, waiting, running, extra = self._snapshot
        return EngineStats(
            rows_total=rows_total or self.max_batch_size,
            rows_used=rows_used,
            positions_used=positions,
            waiting=waiting + max(self._sent - self._received, 0),
            running=running,
            alive=self._alive,
            extra=dict(extra),
        )


def _abort_event(request_id: str, live: _Live) -> TokenEvent:
    return TokenEvent(
        request_id=request_id, index=live.tokens, token_id=-1, token_text="", text="", logprob=0.0,
        special=False, prompt_tokens=live.prompt_tokens, finish_reason=FinishReason.ABORT,
    )  # fmt: skip


def engine_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The engine process's environment: ours, with glibc keeping freed memory up to
    ``MALLOC_HEAP_BYTES`` in its heap (unless the user tuned malloc): by default every
    ``[batch, vocab]`` tensor (12 MiB at batch 64) is a fresh mmap whose pages fault in and are zeroed
    again on every step, which doubled the sampler's host time.

    OpenMP's wait policy is left to libgomp's default (spin ~300k iterations, then sleep). Sleeping
    workers (``OMP_WAIT_POLICY=PASSIVE``) pay a futex wake-up in each of a step's ~600 parallel
    regions, which cost a fifth of the throughput behind the HTTP server (docs/measurements.md).
    """
    out = dict(env)
    if not any(key in out for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")):
        out["MALLOC_MMAP_THRESHOLD_"] = out["MALLOC_TRIM_THRESHOLD_"] = str(MALLOC_HEAP_BYTES)
    return out


def _spawn(factory: wire.CoreFactory) -> tuple[subprocess.Popen[bytes], Connection, wire.EngineInfo]:
    """Start the engine process and wait until its engine is built (or raise why it was not)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        proc = subprocess.Popen(
            [sys.executable, "-c", wire.BOOTSTRAP, str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            env=engine_environment(os.environ),
        )
        conn = Connection(ours.detach())
    root = logging.getLogger()
    handler = root.handlers[0] if root.handlers else None
    fmt = handler.formatter._fmt if handler is not None and handler.formatter is not None else None
    try:
        conn.send(list(sys.path))
        conn.send((factory, root.getEffectiveLevel(), fmt))
        while not conn.poll(0.2):
            if proc.poll() is not None:
                raise EOFError
        kind, payload = conn.recv()
    except (EOFError, OSError):
        _shut_down(proc, conn)
        raise RuntimeError(f"the engine process exited with code {proc.returncode} while starting") from None
    if kind == wire.FAILED:
        _shut_down(proc, conn)
        raise payload
    return proc, conn, payload


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout_s)


def _shut_down(proc: subprocess.Popen[bytes], conn: Connection) -> None:
    """Ask the engine process to stop and close the socket; kill it if it has not exited within
    ``STOP_JOIN_S`` (it ignores SIGTERM)."""
    with contextlib.suppress(OSError, ValueError):
        conn.send((wire.STOP,))
    with contextlib.suppress(OSError):
        conn.close()
    try:
        proc.wait(STOP_JOIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_JOIN_S)


__all__ = ["ProcessEngine"]
